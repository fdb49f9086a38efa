"""A CPU device's weights on 2 MiB pages (jaxserve/engine/huge_pages.py), seen where the kernel reports them:
/proc/self/smaps counts a mapping's huge pages in AnonHugePages."""
import ctypes
import mmap
import os
import re
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.engine.huge_pages import HUGE_PAGE, collapse_to_huge_pages

from helpers import SERVER_KNOBS

KERNEL = tuple(map(int, re.match(r"(\d+)\.(\d+)", os.uname().release).groups()))
pytestmark = pytest.mark.skipif(sys.platform != "linux" or KERNEL < (6, 1),
                                reason="MADV_COLLAPSE, which moves pages in place, is Linux 6.1+")


def huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping that holds address."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_array_is_collapsed_in_place_its_values_unchanged():
    a = jnp.arange(8 << 20, dtype=jnp.float32) * 3   # 32 MiB: malloc maps it on its own
    address, expected = a.unsafe_buffer_pointer(), np.arange(8 << 20, dtype=np.float32) * 3
    collapsed = collapse_to_huge_pages([a])
    # only the regions at the ends can hold other memory or none (the mapping's edges)
    assert collapsed >= a.nbytes - 2 * HUGE_PAGE
    assert huge_bytes_of_mapping(address) >= collapsed
    assert a.unsafe_buffer_pointer() == address
    np.testing.assert_array_equal(np.asarray(a), expected)
    np.testing.assert_array_equal(np.asarray(a + 1), expected + 1)


def test_a_region_straddling_two_mappings_is_not_counted_collapsed():
    """madvise answers 0 for such a region yet collapses nothing in it."""
    area = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.write(b"\1" * len(area))                        # collapse needs pages in place
    start = ctypes.addressof(ctypes.c_char.from_buffer(area))
    first = -(-start // HUGE_PAGE)                       # the first whole region inside the area
    mprotect = ctypes.CDLL(None).mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    middle = (first + 1) * HUGE_PAGE + HUGE_PAGE // 2    # splits region first + 1 between two mappings
    assert mprotect(middle, HUGE_PAGE // 2 + HUGE_PAGE, mmap.PROT_READ) == 0
    buffer = SimpleNamespace(unsafe_buffer_pointer=lambda: first * HUGE_PAGE, nbytes=2 * HUGE_PAGE)
    assert collapse_to_huge_pages([SimpleNamespace(addressable_shards=[SimpleNamespace(data=buffer)])]) == HUGE_PAGE
    assert huge_bytes_of_mapping(first * HUGE_PAGE) == HUGE_PAGE


@pytest.mark.slow
def test_a_cpu_engine_starts_with_its_weights_on_huge_pages(smollm):
    engine = LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS))
    largest = max(engine.runner.params, key=lambda a: a.nbytes)   # the token embedding, tied LM head
    assert largest.nbytes > 8 * HUGE_PAGE
    assert huge_bytes_of_mapping(largest.unsafe_buffer_pointer()) >= largest.nbytes - 2 * HUGE_PAGE
