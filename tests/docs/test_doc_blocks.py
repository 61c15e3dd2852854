"""Every fenced code block in README.md and docs/*.md is run by a test.

The convention (documented in docs/operations.md, "How the blocks on this page are tested"): a
fenced block with a language must directly follow an HTML comment saying how it is run:

- ``<!-- doc-block: run -->``: run as-is (bash with ``-euo pipefail``; python as ``python -c``
  would, in a new process forked from a preloaded interpreter, :mod:`opd_testkit.forkserver`;
  ``opd-store`` commands run the same way, ending without module teardown:
  ``forkserver.QUICK_EXIT_ENV``) in an empty temporary directory; a ``console`` block is a transcript (see
  :func:`run_transcript`): its ``$ `` lines run in one bash session and the lines after each one
  must match that command's stdout, ``...`` matching any text;
- ``<!-- doc-block: run-s3 -->``: the same, with ``AWS_ENDPOINT_URL_S3`` pointing at a fresh moto
  S3 server on loopback whose ``s3://my-bucket/runs/run-1`` holds steps 2 and 4 of
  ``opd-store train --updates 4 --checkpoint-every 2``;
- ``<!-- doc-block: run-by TARGET [TARGET ...] -->``: run by other tests; each ``TARGET`` is a
  pytest id (``tests/x.py::test_name``, the test function must exist) or a repository file
  (``.ci/run``); with only file targets, every command line of the block must appear in one.

An unmarked block, or a marker this harness does not know, fails ``test_every_block_is_marked``,
so new docs cannot ship untested code. Blocks without a language (diagrams, layouts) are not code.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opd_testkit import forkserver

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*doc-block:\s*(?P<kind>[a-z0-9-]+)(?:\s+(?P<arg>\S+(?:\s+\S+)*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[^\s`]*)")
KINDS = {"run", "run-s3", "run-by"}
BASH = {"bash", "sh", "shell"}
TRANSCRIPT = {"console"}
NOT_CODE = {"", "text", "mermaid"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str | None  # the marker's kind, None when unmarked
    arg: str | None

    @property
    def id(self) -> str:
        name = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        return f"{name}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the marker on the nearest non-blank line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            body.append(lines[end][indent:] if lines[end][:indent].strip() == "" else lines[end])
            end += 1
        above = index - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = MARKER.match(lines[above]) if above >= 0 else None
        blocks.append(Block(path, index + 1, opening["lang"].lower(), textwrap.dedent("\n".join(body)) + "\n",
                            marker["kind"] if marker else None, marker["arg"] if marker else None))
        index = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in parse_blocks(path)]
CODE_BLOCKS = [block for block in ALL_BLOCKS if block.lang not in NOT_CODE]


def _ids(block: Block) -> str:
    return block.id


def test_the_parser_sees_the_blocks():
    # A parser that found nothing would pass every test below vacuously.
    assert len(CODE_BLOCKS) >= 10
    assert any(block.path.name == "README.md" for block in CODE_BLOCKS)
    assert {"run", "run-s3", "run-by"} <= {block.kind for block in CODE_BLOCKS}


def test_parser_and_marker_rules(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("x\n\n<!-- doc-block: run -->\n```bash\necho hi\n```\n\n```python\nprint(1)\n```\n\n"
                   "```\nplain diagram\n```\n\n1. item\n\n   <!-- doc-block: run-by .ci/run -->\n"
                   "   ```bash\n   bash scripts/test.sh\n   ```\n")
    blocks = parse_blocks(doc)
    assert [(b.line, b.lang, b.kind, b.arg, b.code) for b in blocks] == [
        (4, "bash", "run", None, "echo hi\n"),
        (8, "python", None, None, "print(1)\n"),
        (12, "", None, None, "plain diagram\n"),
        (19, "bash", "run-by", ".ci/run", "bash scripts/test.sh\n"),
    ]
    assert [marker_problem(b) for b in blocks if b.lang not in NOT_CODE] == [
        None, f"{blocks[1].id}: python block without a <!-- doc-block: ... --> marker", None]


def marker_problem(block: Block) -> str | None:
    """Why a code block's marker is not acceptable, or None."""
    if block.kind is None:
        return f"{block.id}: {block.lang} block without a <!-- doc-block: ... --> marker"
    if block.kind not in KINDS:
        return f"{block.id}: unknown marker kind {block.kind!r} (one of {sorted(KINDS)})"
    if (block.kind == "run-by") != (block.arg is not None):
        return f"{block.id}: only run-by takes an argument"
    if block.kind in ("run", "run-s3") and block.lang not in BASH | TRANSCRIPT | {"python"}:
        return f"{block.id}: cannot run a {block.lang} block"
    return None


def test_every_block_is_marked():
    problems = [problem for block in CODE_BLOCKS if (problem := marker_problem(block))]
    assert problems == []


def _test_exists(target: str) -> bool:
    file_part, _, name = target.partition("::")
    path = REPO / file_part
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return name.split("[")[0] in names


def _commands(code: str) -> list[str]:
    if code.lstrip().startswith("$ "):  # a console transcript: only its commands
        code = "\n".join(command for command, _output in parse_transcript(code))
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in code.replace("\\\n", " ").splitlines()]
    return [re.sub(r"\s+", " ", line) for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("block", [b for b in CODE_BLOCKS if b.kind == "run-by"], ids=_ids)
def test_run_by_targets_exist(block):
    """Each target exists; with only file targets, every command of the block is in one of them."""
    tests = [target for target in block.arg.split() if "::" in target]
    files = [target for target in block.arg.split() if "::" not in target]
    for target in tests:
        assert _test_exists(target), f"{block.id}: no test {target}"
    texts = []
    for target in files:
        path = REPO / target
        assert path.is_file(), f"{block.id}: no file {target}"
        texts.append(re.sub(r"\s+", " ", path.read_text(encoding="utf-8")))
    if not tests:
        missing = [command for command in _commands(block.code) if not any(command in text for text in texts)]
        assert missing == [], f"{block.id}: {files} do not run {missing}"


def test_transcript_rules(tmp_path):
    """Console transcripts: parsing, matching, exit statuses; each rule can fail a block."""
    code = "$ x=4; echo \"step $x\"\nstep 4\n$ printf 'a\\nb\\nc\\n'; \\\n  false\n...\nc\n$ echo $?\n1\n"
    assert parse_transcript(code) == [('x=4; echo "step $x"', ["step 4"]),
                                      ("printf 'a\\nb\\nc\\n'; \\\n  false", ["...", "c"]), ("echo $?", ["1"])]
    assert output_matches(["step ... at ...Z", "..."], ["step 4 at 2026-01-01T00:00:00Z", "x", "y"])
    assert not output_matches(["step ... at ...Z"], ["step 4 at 2026-01-01T00:00:00Z", "x"])
    assert not output_matches(["step 4"], ["step 40"])
    assert output_matches(["...", "c"], ["c"]) and not output_matches([], ["a"])

    def run(code: str, name: str) -> None:
        (tmp_path / name).mkdir()
        work = tmp_path / name / "work"
        work.mkdir()
        run_transcript(Block(tmp_path / "doc.md", 1, "console", code, "run", None), work, _environment(tmp_path))

    run(code, "ok")  # the shell state carries over; the failing `false` is shown by `echo $?`
    for name, bad in [("mismatch", "$ echo 5\n4\n"), ("unshown-status", "$ false\n$ echo after\nafter\n"),
                      ("extra-output", "$ echo 4; echo 5\n4\n"), ("wrong-status", "$ false\n$ echo $?\n0\n")]:
        with pytest.raises(AssertionError):
            run(bad, name)


def _environment(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    # `opd-store` runs through the worker's fork server (imports paid once per worker, not per command).
    shim = forkserver.default_server().shim_dir()
    env["PATH"] = os.pathsep.join([shim, str(Path(sys.executable).parent), env.get("PATH", "")])
    # A block's process ends without module teardown (its atexit hooks and flushes still run): no
    # block is about the interpreter's end (tests/spot/test_exit_paths.py is), and each teardown
    # costs about 0.5 CPU-seconds in a child of the preloaded server.
    env[forkserver.QUICK_EXIT_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["HOME"] = str(home)
    env.pop("AWS_ENDPOINT_URL_S3", None)
    return env


def parse_transcript(code: str) -> list[tuple[str, list[str]]]:
    """The ``(command, expected stdout lines)`` pairs of a console transcript.

    A line starting with ``$ `` is a command (a trailing ``\\`` continues it on the next line);
    the lines up to the next command are its expected stdout (trailing blank lines dropped).
    """
    steps: list[tuple[str, list[str]]] = []
    lines = code.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("$ "):
            raise ValueError(f"a transcript starts with a '$ ' command line, not {line!r}")
        command = line[2:]
        while command.endswith("\\") and index + 1 < len(lines):
            index += 1
            command += "\n" + lines[index]
        index += 1
        output: list[str] = []
        while index < len(lines) and not lines[index].startswith("$ "):
            output.append(lines[index].rstrip())
            index += 1
        while output and not output[-1]:
            output.pop()
        steps.append((command, output))
    return steps


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines match ``expected``: ``...`` in a line matches any text, a line
    that is only ``...`` any number of lines (none included); everything else is compared exactly
    (trailing spaces ignored)."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == "...":
        return any(output_matches(rest, actual[skip:]) for skip in range(len(actual) + 1))
    pattern = ".*".join(re.escape(part) for part in head.rstrip().split("..."))
    return bool(actual) and re.fullmatch(pattern, actual[0].rstrip()) is not None and output_matches(rest, actual[1:])


def run_transcript(block: Block, cwd: Path, env: dict[str, str]) -> None:
    """Run a console transcript in one ``bash -o pipefail`` session and check it.

    Each command's stdout must match the lines shown after it (:func:`output_matches`); stderr is
    not compared (diagnostics, warnings, progress bars). Each command must exit 0 unless the next
    command is ``echo $?``, which then shows its exit status.
    """
    steps = parse_transcript(block.code)
    record = cwd.parent / "transcript"
    record.mkdir()
    script = ["set -o pipefail"]
    for index, (command, _output) in enumerate(steps):
        # Braces, not a subshell: cd and variables carry over; $? is restored for a next `echo $?`.
        script.append(f'{{\n{command}\n}} >"{record}/out.{index}" 2>"{record}/err.{index}"; '
                      f'echo $? >"{record}/rc.{index}"; (exit "$(cat "{record}/rc.{index}")")')
    result = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=900)
    ran = sum(1 for index in range(len(steps)) if (record / f"rc.{index}").is_file())
    assert ran == len(steps), (f"{block.id}: the transcript's shell ran {ran} of {len(steps)} commands "
                               f"(exit {result.returncode})\n{result.stderr[-4000:]}")
    for index, (command, expected) in enumerate(steps):
        stdout = (record / f"out.{index}").read_text()
        stderr = (record / f"err.{index}").read_text()
        status = int((record / f"rc.{index}").read_text())
        shown = index + 1 < len(steps) and steps[index + 1][0].strip() == "echo $?"
        where = f"{block.id}: $ {command}"
        assert status == 0 or shown, (f"{where}\nexited {status} (show a non-zero status with `$ echo $?`)"
                                       f"\n--- stdout\n{stdout[-4000:]}--- stderr\n{stderr[-4000:]}")
        assert output_matches(expected, stdout.splitlines()), (
            f"{where}\n--- shown\n" + "\n".join(expected) + f"\n--- stdout\n{stdout[-4000:]}--- stderr\n{stderr[-4000:]}")


def _run(block: Block, cwd: Path, env: dict[str, str]) -> None:
    # Blocks refer to repository files (deploy/entrypoint.sh): give them the repository's files.
    for name in ("deploy", "scripts"):
        (cwd / name).symlink_to(REPO / name)
    if block.lang in TRANSCRIPT:
        run_transcript(block, cwd, env)
        return
    if block.lang == "python":  # a new process like `python -c`, forked from the preloaded server
        result = forkserver.run([sys.executable, "-c", block.code], cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=900)
    else:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=900)
    assert result.returncode == 0, (f"{block.id} exited {result.returncode}\n--- block\n{block.code}"
                                    f"--- stdout\n{result.stdout[-4000:]}--- stderr\n{result.stderr[-4000:]}")


@pytest.mark.parametrize("block", [b for b in CODE_BLOCKS if b.kind == "run"], ids=_ids)
def test_run_block(block, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _run(block, work, _environment(tmp_path))


@pytest.fixture(scope="session")
def seeded_run(tmp_path_factory) -> Path:
    """A local store holding steps 2 and 4 of ``opd-store train --updates 4 --checkpoint-every 2``."""
    store = tmp_path_factory.mktemp("docs-seed") / "run-1"
    forkserver.run([sys.executable, "-m", "opd_store", "train", "--store", str(store), "--updates", "4",
                    "--checkpoint-every", "2", "--log", os.devnull, "--events", os.devnull],
                   check=True, timeout=900, env=_environment(store.parent), stdout=subprocess.DEVNULL)
    return store


# The first run-s3 block also pays for the seeded run (one training); a block may train twice. The
# blocks share one worker (pytest-xdist), so the session's seeded run is trained once.
@pytest.mark.xdist_group("docs-run-s3")
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("block", [b for b in CODE_BLOCKS if b.kind == "run-s3"], ids=_ids)
def test_run_s3_block(block, tmp_path, moto_s3, seeded_run):
    moto_s3.new_backend("my-bucket")
    # The server's one boto3 client: about a third of the CPU of a new s3fs instance's uploads.
    client = moto_s3.boto3_client()
    for source in sorted(p for p in seeded_run.rglob("*") if p.is_file()):
        client.put_object(Bucket="my-bucket", Key=f"runs/run-1/{source.relative_to(seeded_run).as_posix()}",
                          Body=source.read_bytes())
    env = _environment(tmp_path)
    env["AWS_ENDPOINT_URL_S3"] = moto_s3.endpoint_url
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    work = tmp_path / "work"
    work.mkdir()
    _run(block, work, env)


def test_shutil_which_bash():
    # run blocks need bash; CI images have it, and a missing one must fail loudly, not skip.
    assert shutil.which("bash")
