"""The documents a new user reads (README.md, CHANGELOG.md, docs/*.md, benchmarks/README.md): every
relative link and #anchor resolves, every quoted result file and source path exists, every `dsa`
subcommand and flag quoted in a command exists in the real CLI parser, and the tables that
benchmarks/render.py owns equal a fresh render of the JSON they name. Each failure says file:line."""
import argparse
import functools
import glob
import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "CHANGELOG.md", "benchmarks/README.md",
        *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SHELL = {"", "bash", "sh", "shell", "console"}  # fenced blocks whose lines are commands

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")
RESULT = re.compile(r"benchmarks/results/[\w.{},*<>-]*?\.(?:json|log)\b")
DATED = re.compile(r"[\w{},*.-]*\d{4}-\d{2}-\d{2}[\w{},*.-]*\.(?:json|log)")
SOURCE = re.compile(r"(?:dsa|kernels|cache|indexer|tests|benchmarks)/[\w/.-]*\.(?:py|sh)")
COMMAND = re.compile(r"(?:^|(?<=\s))(?:python3? )?(?:-m )?dsa(?= )")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")


def read_lines(path: str) -> list[tuple[int, str, str | None]]:
    """(line number, text, the language of the fenced block it is in, or None outside fences);
    fence lines themselves are left out, and a line ending in a backslash is joined to the next."""
    out, fence, joined, start = [], None, "", 0
    with open(os.path.join(ROOT, path)) as f:
        for n, line in enumerate(f.read().split("\n"), 1):
            if line.lstrip().startswith("```"):
                fence = line.strip()[3:].strip() if fence is None else None
                continue
            if not joined:
                start = n
            if fence is not None and line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            out.append((start, joined + line, fence))
            joined = ""
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a document's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found, counts = set(), {}
    for _, text, fence in read_lines(path):
        m = re.match(r"#{1,6} (.+)", text)
        if fence is None and m:
            base = slug(m.group(1))
            found.add(f"{base}-{counts[base]}" if base in counts else base)
            counts[base] = counts.get(base, 0) + 1
    return found


def expand(pattern: str) -> list[str]:
    """Brace alternatives, as a shell expands them: a-{x,y}.json -> a-x.json, a-y.json."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def link_problems(path: str) -> list[str]:
    problems, here = [], os.path.dirname(path)
    for n, text, fence in read_lines(path):
        if fence is not None:
            continue
        for target in LINK.findall(SPAN.sub("", text)):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(here, file)) if file else path
            if not os.path.exists(os.path.join(ROOT, resolved)):
                problems.append(f"{path}:{n}: link {target}: no file {resolved}")
            elif anchor and (not resolved.endswith(".md") or anchor not in anchors(resolved)):
                problems.append(f"{path}:{n}: link {target}: no heading #{anchor} in {resolved}")
    return problems


def missing_files(path: str) -> list[str]:
    problems = []
    for n, text, _ in read_lines(path):
        quoted = RESULT.findall(text) + SOURCE.findall(text)
        quoted += ["benchmarks/results/" + s for s in SPAN.findall(text) if DATED.fullmatch(s)]
        for name in quoted:
            if "<" in name:
                continue  # a template: engine-<gpu>-<date>.json
            for one in expand(name):
                if not glob.glob(os.path.join(ROOT, one)):
                    problems.append(f"{path}:{n}: {one} does not exist")
    return problems


class _Parsed(Exception):
    pass


@functools.cache
def cli() -> tuple[argparse.ArgumentParser, dict]:
    """The parser dsa.cli.main builds, caught as it starts parsing, and its subparsers by name."""
    from dsa import cli as dsa_cli

    caught = []
    original = argparse.ArgumentParser.parse_known_args

    def catch(self, *args, **kwargs):
        caught.append(self)
        raise _Parsed

    argparse.ArgumentParser.parse_known_args = catch
    try:
        dsa_cli.main([])
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
    assert caught and caught[0].prog == "dsa", f"dsa.cli.main([]) parsed with {caught[:1]}, not the dsa parser"
    top = caught[0]
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    return top, subs


def commands(text: str, fence: str | None) -> list[str]:
    """The `dsa ...` commands on a line: every one in a shell block, or the inline spans that are one."""
    if fence is not None:
        if fence not in SHELL:
            return []
        segments = [text.split(" #")[0]]
    else:
        segments = [s for s in SPAN.findall(text) if re.match(r"(python3? -m |torchrun .*-m )?dsa ", s)]
    out = []
    for segment in segments:
        for m in COMMAND.finditer(segment):
            rest = segment[m.end():]
            out.append(re.split(r"&&|\|\||[|;]", rest)[0].strip())
    return out


def cli_problems(path: str) -> list[str]:
    top, subs = cli()
    problems = []
    for n, text, fence in read_lines(path):
        for command in commands(text, fence):
            words = command.split()
            if not words:
                continue
            if words[0].startswith("-"):
                parser, name, rest = top, "dsa", words
            elif re.fullmatch(r"[a-z][a-z-]*", words[0]):
                if words[0] not in subs:
                    problems.append(f"{path}:{n}: dsa {words[0]}: no such subcommand (dsa has {', '.join(subs)})")
                    continue
                parser, name, rest = subs[words[0]], f"dsa {words[0]}", words[1:]
                choices = [a.choices for a in parser._actions if not a.option_strings and a.choices]
                if choices and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) and rest[0] not in choices[0]:
                    problems.append(f"{path}:{n}: {name} {rest[0]}: not one of {', '.join(choices[0])}")
            else:
                continue  # a placeholder: dsa <command>, dsa OP
            for flag in FLAG.findall(" ".join(rest)):
                if flag not in parser._option_string_actions:
                    problems.append(f"{path}:{n}: {name} {flag}: no such option")
    return problems


@pytest.mark.parametrize("path", DOCS)
def test_links_resolve(path):
    problems = link_problems(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS)
def test_quoted_files_exist(path):
    problems = missing_files(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS)
def test_cli_commands_exist(path):
    problems = cli_problems(path)
    assert not problems, "\n".join(problems)


BAD = {  # a document with one mistake -> what the check must say, and about which line
    "link": (link_problems, "[x](nothing-here.md)", "doc.md:3: link nothing-here.md: no file"),
    "anchor": (link_problems, "[x](#not-a-heading)", "doc.md:3: link #not-a-heading: no heading"),
    "result": (missing_files, "`benchmarks/results/none-h200-2026-12-01.json`", "doc.md:3: benchmarks/results/none"),
    "braces": (missing_files, "`soak-h200-2026-12-01-run{5,9}.json`", "doc.md:3: benchmarks/results/soak-h200-2026"
               "-12-01-run9.json does not exist"),
    "source": (missing_files, "`dsa/model/nothing.py`", "doc.md:3: dsa/model/nothing.py does not exist"),
    "subcommand": (cli_problems, "`dsa frobnicate`", "doc.md:3: dsa frobnicate: no such subcommand"),
    "flag": (cli_problems, "```\ndsa generate --prompt hi \\\n  --no-such-flag 1   # --ok-in-a-comment\n```",
             "doc.md:4: dsa generate --no-such-flag: no such option"),
    "bench op": (cli_problems, "`python -m dsa bench frobnicate --quick`", "doc.md:3: dsa bench frobnicate: not one"),
}


@pytest.mark.parametrize("check, body, message", BAD.values(), ids=list(BAD))
def test_checks_catch_mistakes(tmp_path, monkeypatch, check, body, message):
    """Each check finds the one mistake of a small document, and nothing in its correct lines."""
    (tmp_path / "doc.md").write_text(f"# Title\n\n{body}\n\n[fine](#title) `dsa serve --port 1` "
                                     "`dsa bench serve --url u` `soak-h200-2026-12-01-run5.json`\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "soak-h200-2026-12-01-run5.json").write_text("{}")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    problems = check("doc.md")
    assert len(problems) == 1 and problems[0].startswith(message), problems


def load_render():
    spec = importlib.util.spec_from_file_location("render", os.path.join(ROOT, "benchmarks", "render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rendered_tables_match_the_json():
    """docs/benchmarks.md holds exactly what `python benchmarks/render.py --write` would write."""
    render = load_render()
    assert render.main(["--check"]) == 0, "run: python benchmarks/render.py --write"


def test_render_replaces_only_between_its_markers():
    render = load_render()
    begin, end = render.markers("t")
    text = f"before\n{begin}\nold\n{end}\nafter\n"
    assert render.replace_tables(text, {"t": "new"}) == f"before\n{begin}\nnew\n{end}\nafter\n"
    with pytest.raises(ValueError, match="render:u begin"):
        render.replace_tables(text, {"u": "new"})


def test_render_refuses_two_files_of_one_op():
    render = load_render()
    with pytest.raises(ValueError, match="two result files of op 'engine'"):
        render.render_table(["engine-h200-2026-12-01.json", "engine-h200-2026-12-01-guard-at-b5ef3ef.json"])
