"""RegionUse: one request's inputs read from and outputs written to registered regions, every bound checked
before a byte is touched, and the regions leased until the request is answered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from shm_kit import region_file

from service.errors import BadRequestError, InvalidInputError
from service.shared_memory.table import SharedMemory
from service.shared_memory.tensors import RegionUse, names_region, shared_input, shared_output

F32 = np.dtype(np.float32)
WHERE = "inputs[0].parameters"



@pytest.fixture
def memory(tmp_path: Path) -> SharedMemory:
    """Regions 'in' (floats 2..9 of a file of floats 0..15) and 'out' (32 bytes from offset 8 of a zero file)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    region_file(shm, "in", 64, np.arange(16, dtype=np.float32).tobytes())
    region_file(shm, "out", 64)
    table = SharedMemory(1, tmp_path / "records", shm_folder=shm)
    table.register_system("in", "/in", 8, 32)
    table.register_system("out", "/out", 8, 32)
    return table


def _users(memory: SharedMemory, name: str) -> int:
    return memory._open[name].users


def _out_bytes(memory: SharedMemory) -> bytes:
    return (memory._shm_folder / "out").read_bytes()


def test_an_input_is_a_copy_of_its_bytes_in_the_region(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        params = {"shared_memory_region": "in", "shared_memory_byte_size": 16, "shared_memory_offset": 4}
        array = use.input(params, WHERE, "x", F32, [2, 2])
        np.testing.assert_array_equal(array, [[3, 4], [5, 6]])
        assert array.dtype == F32 and array.flags.c_contiguous
        array[0, 0] = 100  # the server's own buffer: the client's region is untouched
        assert use.input(params, WHERE, "x", F32, [2, 2])[0, 0] == 3
        whole = use.input({"shared_memory_region": "in", "shared_memory_byte_size": 32}, WHERE, "y", F32, [8])
        assert whole.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]


def test_an_input_of_the_wrong_byte_size_is_refused_naming_it(memory: SharedMemory) -> None:
    with RegionUse(memory) as use, pytest.raises(
            InvalidInputError, match=r"input 'x': shared_memory_byte_size is 12 bytes but shape \[2, 2\] of FP32 "
                                     r"needs 16"):
        use.input({"shared_memory_region": "in", "shared_memory_byte_size": 12}, WHERE, "x", F32, [2, 2])


def test_a_range_past_the_end_of_the_region_is_refused(memory: SharedMemory) -> None:
    params = {"shared_memory_region": "in", "shared_memory_byte_size": 16, "shared_memory_offset": 20}
    with RegionUse(memory) as use, pytest.raises(
            BadRequestError, match=r"inputs\[0\].parameters: offset 20 \+ byte size 16 is past the end of shared "
                                   r"memory region 'in' \(32 bytes\)"):
        use.input(params, WHERE, "x", F32, [4])
    assert _users(memory, "in") == 0  # the lease taken before the bound check ended with the request


@pytest.mark.parametrize(("params", "message"), [
    ({"shared_memory_region": "in"}, "shared_memory_byte_size is required with shared_memory_region"),
    ({"shared_memory_byte_size": 16}, "shared_memory_region must name a registered region"),
    ({"shared_memory_region": "", "shared_memory_byte_size": 16}, "shared_memory_region must name a registered"),
    ({"shared_memory_region": 5, "shared_memory_byte_size": 16}, "shared_memory_region must name a registered"),
    ({"shared_memory_region": "in", "shared_memory_byte_size": 16, "shared_memory_size": 16},
     "unknown parameter 'shared_memory_size'"),
    ({"shared_memory_region": "nope", "shared_memory_byte_size": 16}, "unable to find shared memory region: 'nope'"),
])
def test_malformed_parameters_are_refused(memory: SharedMemory, params: dict[str, object], message: str) -> None:
    with RegionUse(memory) as use, pytest.raises(BadRequestError, match=message):
        use.input(params, WHERE, "x", F32, [4])


@pytest.mark.parametrize("key", ["shared_memory_byte_size", "shared_memory_offset"])
@pytest.mark.parametrize("value", ["16", -1, True, False, 16.0, None])
def test_sizes_must_be_non_negative_integers(memory: SharedMemory, key: str, value: object) -> None:
    params = {"shared_memory_region": "in", "shared_memory_byte_size": 16, key: value}
    with RegionUse(memory) as use, pytest.raises(BadRequestError, match=rf"parameters\.{key} must be a non-negative"):
        use.input(params, WHERE, "x", F32, [4])
    assert _users(memory, "in") == 0


def test_outputs_are_written_and_answered_with_region_size_and_offset(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 16}, "outputs[0]", "a")
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 16, "shared_memory_offset": 16},
                   "outputs[1]", "b")
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 4}, "outputs[2]", "not produced")
        results = {"a": np.array([1, 2, 3], np.int32), "b": np.array([7.5, -1], np.float64), "extra": np.ones(2)}
        params = asyncio.run(use.write_outputs(results))
    assert params == {"a": {"shared_memory_region": "out", "shared_memory_byte_size": 12},
                      "b": {"shared_memory_region": "out", "shared_memory_byte_size": 16, "shared_memory_offset": 16}}
    data = _out_bytes(memory)
    assert data[:8] == bytes(8)  # before the region's own offset
    assert np.frombuffer(data[8:20], np.int32).tolist() == [1, 2, 3]
    assert data[20:24] == bytes(4)
    assert np.frombuffer(data[24:40], np.float64).tolist() == [7.5, -1]
    assert data[40:] == bytes(24)


def test_big_endian_outputs_are_written_little_endian(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 8}, "outputs[0]", "a")
        asyncio.run(use.write_outputs({"a": np.array([1, 258], dtype=">i4")}))
    assert _out_bytes(memory)[8:16] == bytes([1, 0, 0, 0, 2, 1, 0, 0])


def test_an_output_larger_than_its_byte_size_is_refused_before_anything_is_written(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 8}, "outputs[0]", "fits")
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 16, "shared_memory_offset": 8},
                   "outputs[1]", "big")
        results = {"fits": np.array([9, 9], np.int32), "big": np.zeros(5, np.float32)}
        with pytest.raises(BadRequestError, match="request for output 'big' should be at least 20 bytes to hold"):
            asyncio.run(use.write_outputs(results))
    assert _out_bytes(memory) == bytes(64)


def test_an_object_output_cannot_be_written(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 32}, "outputs[0]", "text")
        with pytest.raises(BadRequestError, match="output 'text' should be at least"):
            asyncio.run(use.write_outputs({"text": np.array([b"ab"], dtype=object)}))


def test_the_same_region_serves_an_input_and_an_output_at_different_offsets(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        x = use.input({"shared_memory_region": "out", "shared_memory_byte_size": 8}, WHERE, "x", F32, [2])
        use.output({"shared_memory_region": "out", "shared_memory_byte_size": 8, "shared_memory_offset": 24},
                   "outputs[0]", "y")
        assert _users(memory, "out") == 1  # one lease per region per request
        params = asyncio.run(use.write_outputs({"y": np.array([5, 6], np.float32)}))
        assert x.tolist() == [0, 0]  # the input's bytes are not the output's
        assert use.input({"shared_memory_region": "out", "shared_memory_byte_size": 8, "shared_memory_offset": 24},
                         WHERE, "z", F32, [2]).tolist() == [5, 6]
    assert params["y"] == {"shared_memory_region": "out", "shared_memory_byte_size": 8, "shared_memory_offset": 24}
    assert np.frombuffer(_out_bytes(memory)[32:40], np.float32).tolist() == [5, 6]


def test_release_ends_the_leases_of_every_region_once(memory: SharedMemory) -> None:
    use = RegionUse(memory)
    use.input({"shared_memory_region": "in", "shared_memory_byte_size": 4}, WHERE, "x", F32, [1])
    use.input({"shared_memory_region": "in", "shared_memory_byte_size": 4, "shared_memory_offset": 4}, WHERE,
              "y", F32, [1])
    use.output({"shared_memory_region": "out", "shared_memory_byte_size": 4}, "outputs[0]", "z")
    assert (_users(memory, "in"), _users(memory, "out")) == (1, 1)
    use.release()
    assert (_users(memory, "in"), _users(memory, "out")) == (0, 0)
    use.release()  # twice: nothing more to end
    assert (_users(memory, "in"), _users(memory, "out")) == (0, 0)


def test_a_region_unregistered_during_a_request_is_closed_once_the_request_ends(memory: SharedMemory) -> None:
    with RegionUse(memory) as use:
        x = use.input({"shared_memory_region": "in", "shared_memory_byte_size": 8}, WHERE, "x", F32, [2])
        region = memory._open["in"].region
        memory.unregister("system", "in")
        assert not region.closed
        assert x.tolist() == [2, 3]
        with RegionUse(memory) as later, pytest.raises(BadRequestError, match="unable to find shared memory region"):
            later.input({"shared_memory_region": "in", "shared_memory_byte_size": 8}, WHERE, "y", F32, [2])
        assert not region.closed  # still leased
    assert region.closed  # the request's end was the last lease


def test_shared_tensors_need_the_extension_and_no_classification(memory: SharedMemory) -> None:
    params = {"shared_memory_region": "out", "shared_memory_byte_size": 8}
    assert names_region(params) and names_region({"shared_memory_offset": 0}) and not names_region({"binary": 1})
    with pytest.raises(BadRequestError, match="outputs\\[0\\]: the shared-memory extensions are not available here"):
        shared_output(None, params, "outputs[0]", "y")
    with pytest.raises(BadRequestError, match="the shared-memory extensions are not available here"):
        shared_input(None, params, WHERE, "x", F32, [2])
    with RegionUse(memory) as use, pytest.raises(BadRequestError, match="classification extension cannot write"):
        shared_output(use, {**params, "classification": 2}, "outputs[0]", "y")
