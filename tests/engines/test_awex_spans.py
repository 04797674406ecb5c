"""The AWEX sub-phase spans (engines/weight_sync/awex_spans.py): timed wrappers add each call's wall time to
its span, also when the call raises; awex's colocate writer functions are wrapped by name (awex 0.9.0 is
installed here), and wrapping again re-points at the new spans instead of nesting."""

from __future__ import annotations

import time

import pytest

from mopd_hpc.engines.weight_sync.awex_spans import Spans, time_attribute, time_colocate_writer


def test_timed_accumulates_and_take_resets():
    spans = Spans()
    nap = spans.timed("nap", lambda s: time.sleep(s) or s)
    assert nap(0.02) == 0.02 and nap(0.01) == 0.01

    def boom():
        time.sleep(0.01)
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        spans.timed("boom", boom)()
    got = spans.take()
    assert set(got) == {"nap", "boom"} and 0.03 <= got["nap"] < 0.5 and got["boom"] >= 0.01
    assert spans.take() == {}


def test_colocate_writer_is_timed_by_name(monkeypatch):
    import awex.writer.nccl_writer as nccl_writer

    for attr in ("group_tensors_by_shape_and_dtype", "cuda_ipc_serialize"):  # restored after the test
        monkeypatch.setattr(nccl_writer, attr, getattr(nccl_writer, attr))

    class Client:
        def get_object(self, key, timeout=None):
            time.sleep(0.01)
            return key

    class Writer:
        meta_server_client = Client()

        def convert_parameters(self):
            return {"w": 1}

        def _release_memory_for_weights_exchange(self):
            return None

        def _finish_weights_update(self):
            return None

    writer, first, second = Writer(), Spans(), Spans()
    time_colocate_writer(writer, first)
    time_colocate_writer(writer, second)  # re-pointed, not nested
    assert writer.convert_parameters() == {"w": 1}
    writer._release_memory_for_weights_exchange()
    writer._finish_weights_update()
    assert writer.meta_server_client.get_object("k") == "k"
    assert nccl_writer.group_tensors_by_shape_and_dtype([]) == ([], [])
    got = second.take()
    assert set(got) == {"convert", "writer_release", "wait_readers", "meta_wait", "group_copy"}
    assert got["meta_wait"] >= 0.01 and first.take() == {}
    time_attribute(writer, "no_such_method", second, "x")  # another awex version: left alone
    assert not hasattr(writer, "no_such_method")
