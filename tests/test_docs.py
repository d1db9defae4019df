"""Every code block that README.md and docs/**/*.md tell a user to run is run here, in document order,
so an example cannot rot silently.

A fenced block's language says what it is:

- ```bash: commands, run by bash (`set -euo pipefail`) in the page's own scratch directory, with this
  environment's bin directory first on PATH (`python -m ddpexp`, `ddpexp-report`... resolve to it);
  every command must succeed.
- ```console: `$ command` lines, each followed by output lines that must appear in what the command
  prints (its exit code is not checked: a console block may show a refusal).
- ```python: a script, run by this environment's python in the page's scratch directory.
- anything else (```text for output samples and formulas, ```yaml, ```toml...): shown, not run. A
  block in a runnable-looking language other than these three (sh, shell, py, pycon...), or one
  without a language whose lines are all commands, fails the test: it must say what it is.

Instructions for the test sit in HTML comments right above a block (blank lines between allowed), one
per comment, invisible on the rendered page:

- `<!-- test: skip (why) -->`: not run; the reason is required (a Slurm cluster, GPUs, several
  machines, a command that serves forever, a download).
- `<!-- test: append ARGS -->`: ARGS are added to every command line of the block that starts
  ddpexp's trainer or commbench (`python -m ddpexp`, `ddpexp`, `torchrun ... -m ddpexp`,
  `python -m ddpexp.commbench`, `ddpexp-commbench`), before any trailing `# comment`: the fast
  settings (`trainer.epochs=1 trainer.max_steps=2 trainer.progress=false`, `commbench.smoke=true`).
- `<!-- test: replace OLD => NEW -->`: OLD is replaced by NEW in the block's text before it runs (a
  python block's fast settings, a placeholder such as RUN_DIR).
- `<!-- test: file PATH -->`: the block (any language) is written to PATH in the page's scratch
  directory instead of being run, for later blocks to use.
- `<!-- test: same as PAGE -->`: not run here because PAGE (a path from the repository root) shows the
  same block and runs it; the test checks that PAGE has it, character for character.
- `<!-- test: run by TEST_FILE -->`: not run here because TEST_FILE (a path from the repository root)
  reads the block's lines from this page and runs them, with its own checks; the test checks that
  TEST_FILE names this page.

`multirun/<date>/<time>` in a command stands for the newest sweep directory when the command runs (the
names sort by time), so a report can follow the sweep before it. Blocks of one page share one scratch
directory and run in order; pages are independent.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO

RUNNABLE = {"bash", "console", "python"}
# Languages that look runnable but are not run: say bash, console or python, or text for output.
AMBIGUOUS = {"sh", "shell", "zsh", "shell-session", "sh-session", "py", "python3", "pycon", "ipython"}
VERBS = {"skip", "append", "replace", "file", "same", "run"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
DIRECTIVE = re.compile(r"^\s*<!--\s*test:\s*(?P<body>.*?)\s*-->\s*$")
SWEEP_PLACEHOLDER = "multirun/<date>/<time>"
BIN = Path(sys.executable).parent
BLOCK_TIMEOUT_S = 300


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def get(self, verb: str) -> list[str]:
        return [arg for v, arg in self.directives if v == verb]

    @property
    def runs(self) -> bool:
        return self.lang in RUNNABLE and not any(self.get(v) for v in ("skip", "same", "file", "run"))


def parse_directive(body: str) -> tuple[str, str]:
    verb, _, arg = body.partition(" ")
    if (verb, arg[:3]) in {("same", "as "), ("run", "by ")}:
        arg = arg[3:]
    return verb, arg.strip()


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks with the test's instructions above each."""
    found: list[Block] = []
    pending: list[tuple[str, str]] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        d = DIRECTIVE.match(line)
        if d:
            pending.append(parse_directive(d["body"]))
            i += 1
            continue
        m = FENCE.match(line)
        if not m:
            if line.strip():
                pending = []  # an instruction belongs to the block right below it
            i += 1
            continue
        start, indent, fence = i, len(m["indent"]), m["fence"]
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() or not indent else lines[i].lstrip())
            i += 1
        found.append(Block(page, start + 1, m["lang"].lower(), "\n".join(body) + "\n", pending))
        pending = []
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def problems(block: Block) -> list[str]:
    """Why the block breaks the conventions above (nothing: it is fine)."""
    out = []
    for verb, arg in block.directives:
        if verb not in VERBS:
            out.append(f"unknown instruction {verb!r} (one of: {', '.join(sorted(VERBS))})")
        elif verb == "skip" and not re.fullmatch(r"\(.+\)", arg):
            out.append("skip needs a reason in parentheses: <!-- test: skip (needs a Slurm cluster) -->")
        elif verb == "replace" and " => " not in arg:
            out.append("replace needs OLD => NEW")
        elif verb == "replace" and arg.partition(" => ")[0] not in block.text:
            out.append(f"replace: {arg.partition(' => ')[0]!r} is not in the block")
        elif verb in {"append", "file", "same", "run"} and not arg:
            out.append(f"{verb} needs an argument")
        elif verb == "run" and not (REPO / arg).is_file():
            out.append(f"run by {arg}: no such file")
        elif verb == "run" and str(block.page.relative_to(REPO)) not in (REPO / arg).read_text():
            out.append(f"run by {arg}: it does not name {block.page.relative_to(REPO)}")
    if not block.lang and looks_runnable(block.text):
        out.append("commands in a block without a language: say bash, console or python, or text (shown)")
    elif block.lang in AMBIGUOUS:
        out.append(f"```{block.lang} is neither run nor plainly output: use bash, console, python or text")
    if block.get("append") and block.lang not in {"bash", "console"}:
        out.append("append is for bash and console blocks (use replace in python)")
    if (
        block.get("append")
        and block.lang in {"bash", "console"}
        and not any(launches(line) for line in command_lines(block))
    ):
        out.append("append: no command line in the block starts ddpexp or commbench")
    return out


COMMAND_START = re.compile(
    r"^(\$ |\w+=\S* |python3? |ddpexp|torchrun |tensorboard |make |pip |\.venv/|cd |bash |import |from \w)"
)


def looks_runnable(text: str) -> bool:
    """Every line a command (or a comment): what a block without a language must not hold. A diagram
    that starts with a command line (docs/architecture.md) is not one."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(lines) and all(COMMAND_START.match(ln.lstrip()) for ln in lines)


def command_lines(block: Block) -> list[str]:
    """The block's command lines, continuation lines joined (console: the `$ ` lines)."""
    text = block.text.replace("\\\n", " ")
    if block.lang == "console":
        return [ln[2:] for ln in text.splitlines() if ln.startswith("$ ")]
    return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def split_comment(line: str) -> tuple[str, str]:
    """(command, ' # comment'): the first # outside quotes that follows a space starts a comment."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), "  " + line[i:]
    return line.rstrip(), ""


def launches(line: str) -> bool:
    """Whether the line starts ddpexp's trainer or commbench (what `append` applies to)."""
    try:
        words = shlex.split(split_comment(line)[0])
    except ValueError:
        return False
    while words and re.fullmatch(r"\w+=.*", words[0]):  # VAR=value before the command
        words.pop(0)
    if not words:
        return False
    if words[0] in {"ddpexp", "ddpexp-commbench"}:
        return True
    pairs = set(itertools.pairwise(words))
    return words[0] in {"python", "python3", "torchrun"} and bool(
        pairs & {("-m", "ddpexp"), ("-m", "ddpexp.commbench")}
    )


def prepared(block: Block) -> str:
    """The block's text as the test runs it: replacements made, fast settings appended, the newest
    sweep directory in place of multirun/<date>/<time>."""
    text = block.text
    for arg in block.get("replace"):
        old, _, new = arg.partition(" => ")
        text = text.replace(old, new)
    # Found when the command runs, after the block's earlier lines (a sweep) ran: the names sort by time.
    text = text.replace(SWEEP_PLACEHOLDER, '"$(ls -d multirun/*/* | tail -n 1)"')
    if block.lang in {"bash", "console"}:
        text = text.replace("\\\n", " ")
        extra = " ".join(block.get("append"))
        out = []
        for line in text.splitlines():
            body = line[2:] if block.lang == "console" and line.startswith("$ ") else line
            if extra and (block.lang == "bash" or line.startswith("$ ")) and launches(body):
                command, comment = split_comment(body)
                body = f"{command} {extra}{comment}"
                line = f"$ {body}" if block.lang == "console" else body
            out.append(line)
        text = "\n".join(out) + "\n"
    return text


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the user's modules: the cwd only
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def shell(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


def failure(block: Block, text: str, proc: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{block.where}: the ```{block.lang} block failed (exit {proc.returncode})\n--- ran\n{text}"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )


def run_block(block: Block, cwd: Path) -> None:
    for path in block.get("file"):
        (cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (cwd / path).write_text(block.text)
    if not block.runs:
        return
    text = prepared(block)
    if block.lang == "bash":
        proc = shell(text, cwd)
        assert proc.returncode == 0, failure(block, text, proc)
    elif block.lang == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(text)
        proc = subprocess.run(
            [sys.executable, script.name],
            cwd=cwd,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        assert proc.returncode == 0, failure(block, text, proc)
    else:  # console: each `$ ` command, then the lines it must print
        command: str | None = None
        expected: list[str] = []
        for line in [*text.splitlines(), "$ "]:
            if line.startswith("$ "):
                if command:
                    proc = shell(command, cwd)
                    printed = proc.stdout + proc.stderr
                    missing = [e for e in expected if e not in printed]
                    assert not missing, f"{failure(block, command + chr(10), proc)}\n--- not printed\n" + (
                        "\n".join(missing)
                    )
                command, expected = line[2:].strip(), []
            elif line.strip():
                expected.append(line.strip())


# ---------------------------------------------------------------------------------------------------
# The conventions, checked on every page without running anything.


def test_every_block_is_run_or_says_why_not():
    """A block a user might run is run, or marked skip with a reason, or points to the page that runs
    it; a new unmarked example in an unclear language fails here instead of rotting."""
    bad = [f"{b.where}: {p}" for b in all_blocks() for p in problems(b)]
    assert not bad, "\n".join(bad)


def test_blocks_marked_same_as_are_run_on_that_page():
    runnable = {(b.page, b.text) for b in all_blocks() if b.runs}
    bad = []
    for b in all_blocks():
        for target in b.get("same"):
            page = (REPO / target).resolve()
            if not page.is_file():
                bad.append(f"{b.where}: same as {target}: no such page")
            elif (page, b.text) not in runnable:
                bad.append(f"{b.where}: {target} has no run block with exactly this text")
    assert not bad, "\n".join(bad)


def test_the_conventions_catch_what_they_should(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "```\npython -m ddpexp strategy=ddp\n```\n\n"
        "```\nstep = compute + comm\n```\n\n"
        "```sh\nls\n```\n\n"
        "<!-- test: skip -->\n```bash\nls\n```\n\n"
        "<!-- test: append trainer.epochs=1 -->\n```bash\nls  # a comment\n```\n\n"
        "<!-- test: skip (a reason) -->\n\n```bash\nls\n```\n\n"
        "<!-- test: append trainer.epochs=1 -->\n"
        "```bash\npython -m ddpexp -m strategy=single,ddp  # a sweep\n"
        "ddpexp-report multirun/<date>/<time>\n```\n"
    )
    found = blocks(page)
    assert [bool(problems(b)) for b in found] == [True, False, True, True, True, False, False]
    assert not found[1].runs and not found[5].runs and found[6].runs
    assert prepared(found[6]).splitlines() == [
        "python -m ddpexp -m strategy=single,ddp trainer.epochs=1  # a sweep",
        'ddpexp-report "$(ls -d multirun/*/* | tail -n 1)"',
    ]
    for name in ("10-00-00-000001", "09-59-59-999999"):
        (tmp_path / "multirun" / "2026-01-01" / name).mkdir(parents=True)
    newest = shell('echo "$(ls -d multirun/*/* | tail -n 1)"', tmp_path).stdout.strip()
    assert newest == "multirun/2026-01-01/10-00-00-000001"
    assert launches("torchrun --nproc-per-node=2 -m ddpexp strategy=ddp")
    assert launches("NCCL_DEBUG=INFO python -m ddpexp.commbench backend=gloo")
    assert not launches("python -m ddpexp.report multirun/x") and not launches("ddpexp-predict runs/a")


# ---------------------------------------------------------------------------------------------------
# Each strategy page's settings table against the strategy's config dataclass.


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def test_each_strategy_page_lists_its_settings_and_options():
    """docs/strategies/<name>.md has a row `strategy.<setting>` | default for every field of the
    strategy's schema, and names every conf/strategy option built on that schema."""
    from ddpexp import strategies

    bad = []
    for name in strategies.builtin_names():
        strategy = strategies.get(name)
        page = REPO / "docs" / "strategies" / f"{name}.md"
        if not page.is_file():
            bad.append(f"{name}: no page {page.relative_to(REPO)}")
            continue
        text = page.read_text()
        rows = dict(re.findall(r"^\| `strategy\.(\w+)` \| `([^`]*)` \|", text, re.M))
        for f in dataclasses.fields(strategy.schema):
            if f.name in {"name", "module"}:
                continue
            if f.name not in rows:
                bad.append(f"{page.name}: no row for strategy.{f.name}")
            elif rows[f.name] != _default(f):
                bad.append(f"{page.name}: strategy.{f.name} default {rows[f.name]} != {_default(f)}")
        extra = set(rows) - {f.name for f in dataclasses.fields(strategy.schema)}
        bad += [f"{page.name}: strategy.{k} is not a setting of {name}" for k in sorted(extra)]
        for option in sorted((REPO / "conf" / "strategy").glob("*.yaml")):
            if f"- {name}_schema" in option.read_text() and f"`{option.stem}`" not in text:
                bad.append(f"{page.name}: does not name the option strategy={option.stem}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------
# Running them: one test per page that has a block to run.


RUN_PAGES = [p for p in pages() if any(b.runs for b in blocks(p))]


def _page(page: Path) -> Any:
    """The page as a test case: each block is stopped at BLOCK_TIMEOUT_S (a hang), so the page's timeout
    is theirs together; the suite's default would stop a page of several long blocks that all work."""
    # a console block runs each of its `$ ` lines in a shell of its own
    runs = sum(max(1, len(command_lines(b))) if b.lang == "console" else 1 for b in blocks(page) if b.runs)
    return pytest.param(
        page, id=str(page.relative_to(REPO)), marks=pytest.mark.timeout(BLOCK_TIMEOUT_S * runs)
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("page", [_page(p) for p in RUN_PAGES])
def test_the_page_s_examples_run(page: Path, tmp_path: Path):
    for block in blocks(page):
        run_block(block, tmp_path)
