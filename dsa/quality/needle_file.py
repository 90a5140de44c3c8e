"""The results file of ``dsa needle`` (``needle.jsonl``): a grid that survives being stopped.

Line 1 is the header, what the samples and their scores depend on (the grid's flags, the teacher's
config, the filler streams' sizes, a digest of the indexer files); then one line per finished sample
(its record and each rule's seconds) and one per run that ended cleanly (wall time, device, how it
ended). Each (task, length) draws its samples from its own seeded generator, so the samples are a
function of the header alone: a restart that reads the file back, skips the samples it holds and
appends the others gives the grid of one run. A last line that a kill cut short is dropped on reading.
"""
import hashlib
import json
import os

RESULTS = "needle.jsonl"


def key(record: dict) -> tuple:
    """A sample's place in the grid: ``(task, length, index)``."""
    return record["task"], record["length"], record["index"]


def indexers_digest(folder: str) -> str:
    """sha256 over the names and bytes of the folder's ``.safetensors`` files."""
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        h.update(name.encode())
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def read(path: str) -> tuple:
    """``(header or None, sample lines, run lines)`` of ``path``; an unfinished last line is cut from the file."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    header, samples, runs = None, [], []
    for n, line in enumerate(data[:end].splitlines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {n} is not JSON") from None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if (n == 1) != (kind == "header") or kind not in ("header", "sample", "run"):
            raise ValueError(f"{path}: line {n} is not a needle results line (type {kind!r})")
        if kind == "header":
            header = obj[kind]
        else:
            (samples if kind == "sample" else runs).append(obj[kind])
    return header, samples, runs


def _difference(old: dict, new: dict) -> str:
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict) and a != b:
            return f"{k}: {_difference(a, b)}"
        if a != b:
            return f"{k}: {a!r} there, {b!r} now"
    return "none"


def start(path: str, header: dict, fresh: bool) -> tuple:
    """The sample and run lines ``path`` holds for ``header``; a new file of the header alone when ``fresh``,
    when there is none, or when a kill left it without one. ValueError: it holds another grid."""
    header = json.loads(json.dumps(header))  # as it reads back: tuples become lists
    if not fresh and os.path.exists(path):
        old, samples, runs = read(path)
        if old is not None:
            if old != header:
                raise ValueError(f"{path} holds another grid ({_difference(old, header)})")
            return samples, runs
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"type": "header", "header": header}) + "\n")
    return [], []


def append(path: str, kind: str, payload: dict) -> None:
    """One ``sample`` or ``run`` line, on disk before the call returns (a kill after it loses nothing)."""
    with open(path, "a") as f:
        f.write(json.dumps({"type": kind, kind: payload}) + "\n")
        f.flush()
        os.fsync(f.fileno())
