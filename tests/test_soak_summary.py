"""The soak's memory summary and figure (``dsa.bench.soak``) on synthetic samples: the slopes over the
second half and after the pool fills, and the fits the figure draws."""
import pytest

pytest.importorskip("matplotlib")

from dsa.bench import soak

RSS = "process_resident_memory_bytes"
ROWS = [{"kind": "plain", "outcome": "ok"}] * 20_000  # the requests the marks count


def _samples(full_at: int, before: float, step: float, after: float) -> list:
    """24 marks over 20,000 requests: RSS grows ``before`` B a request, jumps ``step`` at ``full_at``
    (where evictions begin), then grows ``after`` B a request."""
    out = []
    for i in range(1, 25):
        n = i * 20_000 // 24
        rss = (2 << 30) + before * min(n, full_at) + (step + after * (n - full_at) if n >= full_at else 0)
        out.append({"requests": n, RSS: rss, "dsa_prefix_cache_evictions_total": max(0, n - full_at),
                    "dsa_requests_running": 0, "dsa_requests_waiting": 0, "dsa_cache_blocks_in_use": 0,
                    "dsa_gpu_memory_allocated_bytes": 1 << 30})
    return out


@pytest.mark.parametrize("before, after", [(4000.0, 0.0), (4000.0, 500.0), (0.0, 2000.0)],
                         ids=["flat-after-full", "slow-after-full", "grows-after-full"])
def test_the_slope_after_the_pool_fills_is_fitted_from_the_first_eviction(before, after):
    marks = _samples(16_700, before, 40 << 20, after)
    summary = soak.soak_summary(ROWS, marks[:-1], marks[-1])
    full = next(m["requests"] for m in marks if m["dsa_prefix_cache_evictions_total"] > 0)
    assert summary["pool_full_at"] == full
    assert summary["rss_slope_after_full"] == pytest.approx(after, abs=1.0), summary["rss_slope_after_full"]


def test_a_pool_that_never_fills_has_no_slope_after_it():
    marks = _samples(10**9, 4000.0, 0, 0)
    summary = soak.soak_summary(ROWS, marks[:-1], marks[-1])
    assert summary["pool_full_at"] is None and summary["rss_slope_after_full"] is None
    assert summary["rss_slope_bytes_per_request"] == pytest.approx(4000.0, rel=1e-6)


def test_the_figure_draws_both_fits_and_the_pool_full_point(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(soak, "save_figure", lambda fig, out_dir, name: figures.append(fig) or f"{out_dir}/{name}")
    marks = _samples(16_700, 4000.0, 40 << 20, 35.0)
    summary = soak.soak_summary(ROWS, marks[:-1], marks[-1])
    soak.plot_memory(summary, str(tmp_path / "soak-memory.png"))
    labels = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert labels[0] == "resident memory", labels
    assert labels[1].startswith("fit over the second half: ") and labels[1].endswith(" B/request"), labels
    assert labels[2] == "fit after the pool is full: 35 B/request", labels
    assert labels[3] == "prefix cache evicts (pool full)", labels
