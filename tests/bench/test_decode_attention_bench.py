import jax.numpy as jnp
import numpy as np
import pytest

from bench import decode_attention
from kernels.cpu import available


def test_page_tables_share_exactly_the_prefix_pages():
    table = decode_attention._page_table(rows=6, shared=64, own=32, groups=3)
    assert table.shape == (6, 4 + 2)
    for g in range(3):  # rows 2g and 2g + 1 share their first 4 pages, and no other group has them
        assert (table[2 * g, :4] == table[2 * g + 1, :4]).all()
    assert len(np.unique(table[:, :4])) == 3 * 4
    own = table[:, 4:].ravel()
    assert len(np.unique(own)) == own.size and not np.isin(own, table[:, :4]).any()
    assert table.min() == 1  # page 0 is left unused


@pytest.mark.skipif(not available(), reason="the native CPU kernels did not build here")
@pytest.mark.parametrize("queries", [jnp.float32, jnp.bfloat16])  # bf16: the kernels' pair products
def test_a_case_runs_and_counts_its_distinct_pages(queries):
    r = decode_attention.run_case("spec", jnp.dtype(jnp.bfloat16), repeats=1, rng=np.random.default_rng(0),
                                  query_dtype=jnp.dtype(queries))
    tokens = 608  # 8 rows sharing one copy of 608 tokens: read once
    assert r["kv_mb"] == pytest.approx(2 * tokens * 3 * 64 * 2 * 30 / 1e6)
    assert 0 < r["best_ms"] <= r["median_ms"]


@pytest.mark.skipif(not available(), reason="the native CPU kernels did not build here")
def test_the_prefill_case_counts_the_keys_each_new_token_sees():
    r = decode_attention.run_case("prefill", jnp.dtype(jnp.bfloat16), repeats=1, rng=np.random.default_rng(0))
    pairs = 16 * 128 * (1024 + 129 / 2)  # 128 new tokens after 1,024 cached, 16 sequences
    assert r["gflop_s"] == pytest.approx(4 * pairs * 9 * 64 * 30 / (r["best_ms"] / 1e3) / 1e9)
