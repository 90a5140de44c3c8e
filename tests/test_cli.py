"""What a new user's trial of the CLI found: version, refused arguments, help with defaults, a
missing plotting extra named before any work."""
import argparse
import importlib.util
import subprocess
import sys

import pytest

import dsa
from dsa.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dsa {dsa.__version__}"


@pytest.mark.parametrize("flag", ["--context", "--new-tokens", "--batch", "--max-batch-tokens"])
def test_demo_refuses_non_positive_sizes(flag):
    with pytest.raises(SystemExit, match=f"{flag} must be a positive number, got 0"):
        main(["demo", flag, "0", "--device", "cpu"])


def test_generate_refuses_bad_sampling():
    with pytest.raises(SystemExit, match="top_p"):
        main(["generate", "--prompt", "x", "--top-p", "0", "--device", "cpu"])


def test_recall_help_shows_defaults_and_a_sweep_within_the_context(capsys):
    with pytest.raises(SystemExit):
        main(["recall", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1024)" in text and "(default: 32)" in text and "(default: tiny)" in text
    from dsa.quality.choices import SWEEP
    assert f"from {SWEEP[0]} to {SWEEP[-1]} below the context" in text
    assert [k for k in SWEEP if k < 1024] == [64, 128, 256, 512]


@pytest.mark.parametrize("argv,command", [(["recall", "--device", "cpu"], "dsa recall"),
                                          (["bench", "plot"], "dsa bench plot")])
def test_missing_matplotlib_is_named_before_any_work(argv, command, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    import dsa.model.model
    monkeypatch.setattr(dsa.model.model.DSAModel, "random", lambda *a, **k: pytest.fail("computed before refusing"))
    with pytest.raises(SystemExit, match=r"\[eval\]"):
        main(argv + ["--out", str(tmp_path)] if command == "dsa recall" else argv + ["--results", str(tmp_path)])


def _bad_checkpoint(tmp_path, case: str, text_checkpoint) -> tuple:
    """A bad checkpoint folder and the path its error must name."""
    folder = tmp_path / "ckpt"
    if case == "missing-folder":
        return folder, str(folder)
    folder.mkdir()
    if case == "missing-config":
        return folder, str(folder / "config.json")
    config = folder / "config.json"
    config.write_text("{not json" if case == "bad-json" else (text_checkpoint / "config.json").read_text())
    if case == "bad-safetensors":
        (folder / "model.safetensors").write_bytes(b"not a safetensors file")
        return folder, str(folder / "model.safetensors")
    return folder, str(config if case == "bad-json" else folder)


@pytest.mark.parametrize("command", ["serve", "generate", "demo"])
@pytest.mark.parametrize("case", ["missing-folder", "missing-config", "bad-json", "missing-safetensors",
                                  "bad-safetensors"])
def test_bad_checkpoints_exit_with_one_line_naming_the_path(command, case, tmp_path, text_checkpoint):
    folder, named = _bad_checkpoint(tmp_path, case, text_checkpoint)
    argv = [command, "--checkpoint", str(folder), "--device", "cpu"] + (["--prompt", "x"] if command == "generate"
                                                                       else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert message.startswith(f"dsa {command}: ") and named in message and "\n" not in message, message


def test_help_is_plain_text(capsys):
    for argv in (["--help"], ["serve", "--help"], ["demo", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "`" not in capsys.readouterr().out


def _subparsers():
    from dsa.cli import build_parser
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_parsers_build_without_torch():
    """Every --help is built from torch-free modules (torch alone takes seconds to import)."""
    code = ("import sys; from dsa.cli import build_parser; build_parser(); "
            "print(' '.join(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"building the parsers imported {out}"


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_help_shows_every_default(command):
    """An option with a default says it in --help (argparse's %(default)s or the words it stands for)."""
    parser = _subparsers()[command]
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS
               and not any(a.default is v for v in (None, False, argparse.SUPPRESS)) and "default" not in (a.help or "")]
    assert not missing, f"dsa {command} --help: no default shown for {missing}"
    text = parser.format_help()
    assert "%(" not in text and "(default: " in text


def test_preset_names_are_the_presets():
    from dsa.model.preset_names import PRESET_NAMES
    from dsa.model.presets import PRESETS
    assert tuple(PRESETS) == PRESET_NAMES, f"presets {tuple(PRESETS)} vs names {PRESET_NAMES}"
    for command in ("serve", "recall", "bench"):
        preset = next(a for a in _subparsers()[command]._actions if "--preset" in a.option_strings)
        assert tuple(preset.choices) == PRESET_NAMES, f"dsa {command} --preset offers {preset.choices}"


def test_generate_help_shows_the_real_sampling_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 is greedy (default: the model's generation_config.json, 0.7 for the embedded default; else 0)" in text
    assert "--top-p TOP_P default: the model's generation_config.json (0.9 for the embedded default), else 1.0" in text


DEVICE_COMMANDS = {  # command -> the rest of a command line that would otherwise run
    "demo": ["demo"], "generate": ["generate", "--prompt", "x"], "serve": ["serve"], "recall": ["recall"],
    "recall-teacher": ["recall", "--teacher", "--text", "x.npy"], "needle": ["needle", "--text", "x.npy"],
    "fit-indexer": ["fit-indexer", "--train", "x.npy"], "bench-serve": ["bench", "serve"],
}


@pytest.fixture
def no_cuda(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("device", ["cuda", "gpu", "cuda:1"])
@pytest.mark.parametrize("command", sorted(DEVICE_COMMANDS))
def test_a_cuda_device_without_one_is_one_line(command, device, no_cuda, tmp_path):
    argv = DEVICE_COMMANDS[command] + ["--device", device]
    with pytest.raises(SystemExit) as e:
        main(argv + (["--out", str(tmp_path)] if command.startswith(("recall", "needle", "fit")) else []))
    message = str(e.value.code)
    prog = "dsa " + " ".join(DEVICE_COMMANDS[command][:2 if command == "bench-serve" else 1])
    assert message.startswith(f"{prog}: --device {device}: no CUDA device is available") and "\n" not in message, message
    assert "use --device cpu" in message, message


@pytest.mark.parametrize("device", ["mps", "tpu", "cuda:x", ""])
def test_an_unknown_device_is_one_line(device):
    with pytest.raises(SystemExit, match=f"dsa demo: --device {device}: expected cpu, cuda, cuda:N, gpu or gpu:N$"):
        main(["demo", "--device", device])


@pytest.mark.parametrize("value,want", [("gpu", "cuda"), ("GPU:1", "cuda:1"), ("cuda", "cuda"), ("cpu", "cpu"),
                                        (None, "cuda")])
def test_gpu_is_cuda(value, want, monkeypatch):
    import torch

    from dsa.commands.options import device_from_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = argparse.Namespace(device=value)
    assert device_from_args(args, "demo") == torch.device(want) and args.device == want
    args.device = "cuda:2"
    with pytest.raises(SystemExit, match=r"--device cuda:2: there are 2 CUDA devices \(cuda:0 to cuda:1\)$"):
        device_from_args(args, "demo")


@pytest.mark.parametrize("command", ["recall", "needle", "fit-indexer", "bench"])
def test_results_go_under_out_by_default(command):
    out = next(a for a in _subparsers()[command]._actions if "--out" in a.option_strings)
    assert out.default.startswith("out/"), f"dsa {command} --out defaults to {out.default}, inside the checkout"


def _existing(tmp_path, name):
    (tmp_path / name).write_text("{}")
    return str(tmp_path / name)


OVERWRITES = {  # case -> (argv given tmp_path, the flag the refusal names, the existing file)
    "demo": lambda t: (["demo", "--device", "cpu", "--json", _existing(t, "demo.json")], "--json", "demo.json"),
    "recall": lambda t: (["recall", "--device", "cpu", "--out", str(t)], "--out", "recall.json"),
    "recall-teacher": lambda t: (["recall", "--teacher", "--text", "x.npy", "--out", str(t)], "--out", "quality.json"),
    "needle": lambda t: (["needle", "--text", "x.npy", "--device", "cpu", "--out", str(t)], "--out",
                         "needle_accuracy.png"),
    "bench-serve": lambda t: (["bench", "serve", "--preset", "tiny", "--device", "cpu", "--json",
                               _existing(t, "serve.json")], "--json", "serve.json"),
    "bench-plot": lambda t: (["bench", "plot", "--figures", str(t)], "--figures", "dsa_vs_dense.png"),
}


@pytest.mark.parametrize("case", sorted(OVERWRITES))
def test_an_existing_result_file_is_refused_before_any_work(case, tmp_path, monkeypatch):
    argv, flag, name = OVERWRITES[case](tmp_path)
    _existing(tmp_path, name)
    import dsa.model.model
    monkeypatch.setattr(dsa.model.model.DSAModel, "random", lambda *a, **k: pytest.fail("worked before refusing"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert message == f"dsa {' '.join(argv[:2]) if case.startswith('bench') else argv[0]}: {flag}: " \
                      f"{tmp_path / name} exists; give another {flag}, or --overwrite to replace it", message


def test_fit_indexer_refuses_an_existing_indexer_file(tmp_path, monkeypatch):
    from quality_utils import write_tiny_gguf
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    (tmp_path / "fit").mkdir()
    _existing(tmp_path / "fit", "layer_01.safetensors")
    import dsa.quality.fit
    monkeypatch.setattr(dsa.quality.fit, "fit", lambda *a, **k: pytest.fail("trained before refusing"))
    with pytest.raises(SystemExit, match=r"^dsa fit-indexer: --out: .*layer_01.safetensors exists; give another --out"):
        main(["fit-indexer", "--gguf", str(tmp_path / "tiny.gguf"), "--train", "x.npy", "--device", "cpu",
              "--out", str(tmp_path / "fit")])


def test_overwrite_replaces_a_result_file(tmp_path):
    _existing(tmp_path, "recall.json")
    assert main(["recall", "--device", "cpu", "--context", "256", "--queries", "4", "--topk", "64", "--out",
                 str(tmp_path), "--overwrite"]) == 0
    assert "by_k" in (tmp_path / "recall.json").read_text()
