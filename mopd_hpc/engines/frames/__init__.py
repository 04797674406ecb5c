"""Tensors between processes as binary frames (DESIGN.md §7).

- `codec`: one frame of named tensors plus a JSON `meta`, byte for byte a safetensors file.
- `over_http`: frames over aiohttp (content negotiation, a bounded body reader, a frame response).
- `buffer_pool`: byte buffers reused between frames.
"""
