"""A CPU device's weights on 2 MiB pages (jaxserve/engine/huge_pages.py), seen where the kernel reports them:
/proc/self/smaps counts a mapping's huge pages in AnonHugePages."""
import os
import re
import sys

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


@pytest.mark.slow
def test_a_cpu_engine_starts_with_its_weights_on_huge_pages(smollm):
    engine = LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS))
    largest = max(engine.runner.params, key=lambda a: a.nbytes)   # the token embedding, tied LM head
    assert largest.nbytes > 8 * HUGE_PAGE
    assert huge_bytes_of_mapping(largest.unsafe_buffer_pointer()) >= largest.nbytes - 2 * HUGE_PAGE
