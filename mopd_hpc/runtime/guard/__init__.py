"""The node guard (DESIGN.md §4): `server` (aiohttp app and lifecycle), `api` (request bodies), `auth`
(token file, constant-time check), `roles` (registered entry points), `children` (spawn/watch/kill of
process groups), `pdeath_exec` (parent-death-signal exec wrapper), `events` (JSONL), `client` (urllib)."""
