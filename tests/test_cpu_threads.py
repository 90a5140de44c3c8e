"""The CPU thread setting (dsa.engine.cpu_threads): applied when the user set none, kept when they
did; measured with a stand-in for the other processes' CPU use (no timing)."""
import pytest
import torch

from dsa.engine import cpu_threads as ct
from dsa.model.presets import preset_model
from dsa.serve.llm import LLM
from dsa.serve.tokenizer import ByteTokenizer


@pytest.fixture
def fresh(monkeypatch):
    """A process where nobody chose a count: no environment variable, torch at one thread per CPU
    (2 CPUs here), nothing chosen before; torch's count restored afterwards."""
    before = torch.get_num_threads()
    for name in ct.USER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ct, "available_cpus", lambda: 2)
    monkeypatch.setattr(ct, "_chosen", [None])
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def busy(value):
    calls = []

    def measure():
        calls.append(value)
        return value
    measure.calls = calls
    return measure


@pytest.mark.parametrize("cpus, others, expected", [(2, 0.0, 2), (2, 0.4, 2), (2, 1.0, 1), (2, 1.7, 1), (2, 3.5, 1),
                                                    (8, 2.2, 6), (2, None, 2), (1, 0.0, 1)],
                         ids=["idle", "a-little", "one-busy", "almost-two", "overloaded", "8-cpus", "unknown", "1-cpu"])
def test_default_is_the_cpus_others_leave_free(cpus, others, expected):
    assert ct.default_threads(cpus, others) == expected


@pytest.mark.parametrize("others, expected", [(0.0, 2), (1.0, 1)], ids=["idle", "one-busy"])
def test_the_default_is_applied_when_the_user_set_none(fresh, others, expected):
    measure = busy(others)
    threads, why = ct.apply_cpu_threads(None, measure)
    assert (threads, torch.get_num_threads()) == (expected, expected), why
    assert measure.calls == [others] and "busy with other work" in why
    again = busy(0.0)
    assert ct.apply_cpu_threads(None, again) == (threads, why) and not again.calls, "chosen once per process"


@pytest.mark.parametrize("name", ct.USER_ENV)
def test_an_environment_variable_is_kept(fresh, monkeypatch, name):
    monkeypatch.setenv(name, "2")
    measure = busy(1.0)
    assert ct.apply_cpu_threads(None, measure) == (2, f"kept: {name}=2")
    assert torch.get_num_threads() == 2 and not measure.calls


def test_torch_set_num_threads_by_the_user_is_kept(fresh):
    torch.set_num_threads(3)
    assert ct.apply_cpu_threads(None, busy(0.0)) == (3, "kept: torch.set_num_threads")
    assert torch.get_num_threads() == 3


def test_an_explicit_count_wins_over_everything(fresh, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ct.apply_cpu_threads(1, busy(0.0)) == (1, "asked for") and torch.get_num_threads() == 1


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), ("2", TypeError), (True, TypeError),
                                        (1.5, TypeError)], ids=["0", "negative", "str", "bool", "float"])
def test_bad_counts_name_the_argument(fresh, bad, error):
    with pytest.raises(error, match="cpu_threads"):
        ct.apply_cpu_threads(bad)
    assert torch.get_num_threads() == 2


def test_others_busy_reads_the_cpus():
    others = ct.others_busy(0.01)
    assert others is None or 0.0 <= others, others


def test_llm_applies_and_reports_the_count(fresh):
    llm = LLM.from_model(preset_model("tiny", "cpu"), ByteTokenizer(), num_blocks=4, cpu_threads=1)
    assert (llm.cpu_threads, llm.cpu_threads_reason, torch.get_num_threads()) == (1, "asked for", 1)


@pytest.mark.parametrize("command", ["generate", "demo", "serve"])
def test_cli_refuses_a_count_below_1_in_one_line(command):
    from dsa.cli import main
    argv = [command, "--cpu-threads", "0", "--device", "cpu"] + (["--prompt", "x"] if command == "generate" else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value) == f"dsa {command}: --cpu-threads must be at least 1, got 0"
