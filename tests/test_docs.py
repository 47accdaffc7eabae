"""Every example in the README and the guides runs, and every console transcript that a test can
produce still matches what the code prints (numbers, paths and names may vary): a block that no
longer runs fails here. How each block is checked is its directive (``tests/docs_blocks.py``)."""

from __future__ import annotations

import ast
import importlib
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hf_lowzero.testing import free_port, rank_environment
from tests.docs_blocks import FENCE, ROOT, Block, blocks, doc_files, missing_lines
from tests.docs_setups import SETUPS
from tests.ray_env import as_a_user_runs
from tests.tiers import ray_run

ALL = blocks()
PYTHON = [b for b in ALL if b.lang == "python"]
SHELL = [b for b in ALL if b.lang in ("bash", "sh", "shell", "console")]
TRANSCRIPTS = [b for b in ALL if b.directive.startswith("transcript")]


def _param(block: Block):
    marks = [pytest.mark.slow] if block.slow else []
    if block.slow and Path(block.file).name.startswith("ray"):  # the Ray guides' examples start Ray,
        marks += [pytest.mark.ray_cluster, pytest.mark.ray_late]  # each its own: after the rest (tests/tiers.py)
    return pytest.param(block, id=block.id, marks=marks)


def _run_block(rank: int, world_size: int, port: int, block: Block, work: str) -> None:
    os.environ.update(rank_environment(rank, world_size, port))  # the example's own code joins through env://
    os.chdir(work)
    torch.set_num_threads(1)
    names: dict = {"__name__": "__docs__"}
    for setup in block.setups:
        names.update(SETUPS[setup](Path(work)))
    exec(compile(block.code, block.id, "exec"), names)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as hf_lowzero.testing's ranks: gloo's threads may abort the interpreter's shutdown


@pytest.mark.parametrize("block", [_param(b) for b in PYTHON if not b.needs])
def test_a_python_example_runs(block, tmp_path):
    unknown = set(block.setups) - set(SETUPS)
    assert not unknown, f"{block.id}: unknown setup {unknown}; known: {sorted(SETUPS)}"
    mp.spawn(_run_block, args=(block.ranks, free_port(), block, str(tmp_path)), nprocs=block.ranks, join=True)


def test_every_block_says_how_it_is_checked():
    """A shell block runs in a test, names the test that runs it, or says what it needs; a
    directive is one this harness knows."""
    wrong = []
    for b in ALL:
        d = b.directive
        if b in SHELL and not re.match(r"(run|covered|needs|transcript)\b", d):
            wrong.append(f"{b.id}: a shell block needs <!-- test: run | covered tests/...::test_... | needs ... -->")
        if d and not re.match(r"(run|covered|needs|transcript|setup=)", d):
            wrong.append(f"{b.id}: unknown directive {d!r}")
        m = re.match(r"covered (\S+?)(?:::(\w+))?$", d)
        if m and m.group(2) and f"def {m.group(2)}(" not in (ROOT / m.group(1)).read_text():
            wrong.append(f"{b.id}: {m.group(1)} has no test {m.group(2)}")
        if m and not m.group(2) and not all(c in (ROOT / m.group(1)).read_text() for c in _commands(b)):
            wrong.append(f"{b.id}: {m.group(1)} does not run {_commands(b)}")
    assert not wrong, "\n".join(wrong)


BAD_INPUTS_HEADER = "| input | what you see | test |"


def bad_input_rows() -> list[tuple[str, str]]:
    """Every row of the guides' bad-input tables (``docs/checkpoints.md``, ``docs/bad-inputs.md``):
    ``(where, the test cell)``."""
    rows = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for start in [i for i, line in enumerate(lines) if line.strip() == BAD_INPUTS_HEADER]:
            for n, line in enumerate(lines[start + 2 :], start + 3):
                if not line.startswith("|"):
                    break
                rows.append(
                    (f"{path.relative_to(ROOT)}:{n}", line.rstrip().removesuffix("|").rsplit("|", 1)[1].strip())
                )
    return rows


def test_every_bad_input_names_a_test_that_exists():
    """Each row of the bad-input tables names the test that runs it as a pytest node id: the file
    must exist and define that test function, so the tables cannot go stale."""
    rows = bad_input_rows()
    assert {where.split(":")[0] for where, _ in rows} == {"docs/checkpoints.md", "docs/bad-inputs.md"}
    assert len(rows) >= 40, len(rows)  # every input of issue 55, and the earlier checkpoint ones
    wrong = []
    for where, cell in rows:
        m = re.fullmatch(r"`(tests/test_\w+\.py)::(test_\w+)(\[[^\]]+\])?`", cell)
        if m is None:
            wrong.append(f"{where}: {cell!r} is not a node id `tests/test_x.py::test_y`")
            continue
        file, name = ROOT / m.group(1), m.group(2)
        defined = (
            {n.name for n in ast.parse(file.read_text()).body if isinstance(n, ast.FunctionDef)}
            if file.is_file()
            else set()
        )
        if name not in defined:
            wrong.append(f"{where}: {m.group(1)} has no test {name}")
    assert not wrong, "\n".join(wrong)


def test_ci_runs_the_readme_test_command_as_given():
    """A user's first test run is the README's command, install included: CI runs that very line, so it fails
    where theirs would (an install of more extras first would hide a package the tests need)."""
    (readme,) = [b for b in SHELL if b.id.startswith("README.md") and b.directive == "covered .ci/run"]
    lines = (ROOT / ".ci/run").read_text().splitlines()
    runs = [line for line in lines if readme.code.strip() in line]
    assert len(runs) == 1, f".ci/run must run the README's test command as given: {readme.code.strip()}"
    installs = [line for line in lines[: lines.index(runs[0])] if "pip install" in line and ".[" in line]
    assert installs == [], f".ci/run installs extras before the README's command: {installs}"


def test_ci_runs_every_slow_test_in_one_lane_that_prints_its_15_slowest():
    """.ci/run's slow-tier lanes (tests/tiers.py): their marker expressions split the slow tier with no test run twice
    and none left out (the rest, then ray_late, in one lane; the two Ray lanes), and each run prints its 15 slowest
    tests."""
    text = (ROOT / ".ci/run").read_text()
    runs = [line for line in text.splitlines() if "python -m pytest" in line and '"not slow"' not in line]
    assert runs and all("--durations=15" in line for line in runs), runs
    expressions = re.findall(r'-m "([^"$]+)"', text) + re.findall(r'^ray_lane \w+ "([^"]+)"', text, re.M)
    groups = [m for m in expressions if m != "not slow"]
    assert len(groups) == 4, groups
    names = ("slow", "ray_cluster", "ray_nodes", "ray_late")
    for extra in itertools.product([False, True], repeat=3):
        marks = {"slow"} | {name for name, on in zip(names[1:], extra) if on}
        chosen = [m for m in groups if eval(m, {}, {k: k in marks for k in names})]
        assert len(chosen) == 1, (marks, chosen)
    late = re.search(
        r'^python -m pytest -q -m "slow and not ray_cluster".*\n(?:\w+=0\n)?ray_lane \w+ "([^"]+)"', text, re.M
    )
    assert late and "ray_late" in late.group(1), "the rest's lane no longer runs the ray_late tests after the rest"


def _commands(block: Block) -> list[str]:
    """The block's commands, its lines joined at ``\\``, comments and installs (``pip ... &&``) left out."""
    text = re.sub(r"\\\n\s*", " ", block.code)
    commands = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        commands.append(re.sub(r"^pip install [^&]*&&\s*", "", line))
    return commands


@pytest.mark.parametrize("block", [_param(b) for b in SHELL if b.directive.startswith("run")])
def test_a_shell_example_runs(block, tmp_path):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    for command in _commands(block):
        done = subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{block.id}: {command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


# ------------------------------------------------------------------ transcripts


def _transcripts(name: str) -> list[Block]:
    found = [b for b in TRANSCRIPTS if b.directive.split()[1] == name]
    assert found, f"no transcript named {name!r} in the docs"
    return found


def _assert_matches(name: str, output: str) -> None:
    for b in _transcripts(name):
        missing = missing_lines(b.code, output, joined="joined" in b.directive)
        assert not missing, f"{b.id}: these lines are no longer printed:\n" + "\n".join(missing) + f"\n---\n{output}"


def test_every_transcript_is_compared():
    names = {b.directive.split()[1] for b in TRANSCRIPTS}
    compared = {"integrity-alarm", "main-job", "failure-from-memory", "rollback", "plan", "plan-devices"}
    assert names <= compared, f"transcripts no test compares: {names - compared}"


def test_a_transcript_keeps_order_within_each_process_only():
    # Ray streams the workers' lines to the driver's stderr on its own schedule: the driver's
    # summary (stdout) may come first. Order still counts within one process, and a changed line
    # is still caught.
    w = "(RayTrainWorker pid=1) "
    transcript = f"{w}attempt 1: 4 steps\n...\n{w}step  4/4 | loss 2.8\n\nfinal loss 2.8\n"
    output = "final loss 3.0\n\x1b[36m(RayTrainWorker pid=77)\x1b[0m attempt 1: 4 steps\n"
    output += "(RayTrainWorker pid=77) step  4/4 | loss 2.9\n"
    assert missing_lines(transcript, output) == []
    reordered = (
        "final loss 3.0\n(RayTrainWorker pid=7) step  4/4 | loss 2.9\n(RayTrainWorker pid=7) attempt 1: 4 steps\n"
    )
    assert missing_lines(transcript, reordered) == [f"{w}step  4/4 | loss 2.8"]
    assert missing_lines(transcript, output.replace("final loss", "last loss")) == ["final loss 2.8"]
    other_actor = output.replace("(RayTrainWorker", "(TrainController")
    assert missing_lines(transcript, other_actor) == [f"{w}attempt 1: 4 steps", f"{w}step  4/4 | loss 2.8"]


def _alarm(rank: int, world_size: int, out: str) -> None:
    from hf_lowzero import IntegrityError, LowLevelZeroOptimizer
    from hf_lowzero.zero.integrity.reduction_faults import Fault, inject
    from tests.hf_models import TokenDataset, tiny_gpt2

    model = tiny_gpt2()
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2, verify_every=1)
    batch = TokenDataset(n=4, length=16)[rank]
    with inject(Fault("drop", rank=1, step=1, bucket=0)):
        try:
            opt.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
            opt.step()
        except IntegrityError as e:
            Path(out, f"alarm_{rank}.txt").write_text(f"IntegrityError: {e}")


def test_the_integrity_alarm_is_what_a_dropped_gradient_raises(tmp_path):
    from hf_lowzero.testing import run_distributed

    run_distributed(_alarm, 3, out=str(tmp_path))
    _assert_matches("integrity-alarm", (tmp_path / "alarm_0.txt").read_text())


def _job(*flags: str, storage: Path) -> str:
    command = [sys.executable, "ray_jobs/finetune.py", "--storage-path", str(storage), *flags]
    env = as_a_user_runs(dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))  # the console a user sees
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> str:
    """The console of ``python ray_jobs/finetune.py``, as a newcomer runs it."""
    return _job("--name", "clean", storage=tmp_path_factory.mktemp("main_job"))


@ray_run
def test_the_main_jobs_console(main_job):
    _assert_matches("main-job", main_job)


@ray_run
def test_a_failure_resumes_from_memory_as_the_recovery_guide_shows(main_job, tmp_path):
    """The main job with its defaults: a worker killed at step 15 resumes from the memory snapshot
    that ``auto`` took, and ends with the loss of the run without a failure."""
    failed = _job("--name", "failed", "--inject-failure-at-step", "15", storage=tmp_path)
    _assert_matches("failure-from-memory", failed)
    assert "resumed from memory" in failed
    final = [re.search(r"final loss\s+(\S+)", out).group(1) for out in (main_job, failed)]
    assert final[0] == final[1], final


@ray_run
def test_a_rollback_is_one_line_per_event_as_the_integrity_guide_shows(main_job, tmp_path):
    """The rollback demo (about 90 s here: the slow tier): its event lines are the guide's, no rank
    prints a traceback, and it ends with the loss of the run without the fault."""
    flags = _commands(_transcripts("rollback")[0])[0].split("ray_jobs/finetune.py", 1)[1].split()
    rolled = _job("--name", "rolled", *flags, storage=tmp_path)
    _assert_matches("rollback", rolled)
    assert "Traceback" not in rolled and "Error in training function" not in rolled, rolled[-5000:]
    final = [re.search(r"final loss\s+(\S+)", out).group(1) for out in (main_job, rolled)]
    assert final[0] == final[1], final


@pytest.mark.slow
def test_the_plans_table(tmp_path):
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path / "gpt2-124m")  # GPT-2 124M's config, named as the guide's
    (block,) = [b for b in SHELL if "hf_lowzero.trainer.plan_cli" in b.code and b.file.endswith("plan.md")][:1]
    (command,) = _commands(block)
    command = command.replace("path/to/model_or_config.json", str(tmp_path / "gpt2-124m" / "config.json"))
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_matches("plan", done.stdout)


@pytest.mark.slow
def test_the_plan_without_a_device_size(tmp_path, capsys, monkeypatch):
    """The guide's command without --device-memory, on a machine without a GPU (on one with a GPU the
    command plans for it: only the size query is left out here)."""
    from transformers import GPT2Config

    from hf_lowzero.plan import devices
    from hf_lowzero.trainer.plan_cli import main as plan_main

    GPT2Config().save_pretrained(tmp_path / "gpt2-124m")
    (block,) = [b for b in SHELL if b.directive.endswith("test_the_plan_without_a_device_size")]
    (command,) = _commands(block)
    command = command.replace("path/to/model_or_config.json", str(tmp_path / "gpt2-124m" / "config.json"))
    monkeypatch.setattr(devices, "this_gpu", lambda: None)
    assert plan_main(shlex.split(command)[3:]) == 0
    _assert_matches("plan-devices", capsys.readouterr().out)


def test_the_docstring_check_covers_every_public_module():
    """.ci/lint (the first step of .ci/run) checks the docstrings (ruff's D rules) of the modules that define
    the public names."""
    import inspect

    import hf_lowzero
    import hf_lowzero.ray
    import hf_lowzero.recipes.clm_ray

    modules = (hf_lowzero, hf_lowzero.ray, hf_lowzero.recipes.clm_ray)
    public = {str(Path(inspect.getsourcefile(module)).relative_to(ROOT)) for module in modules}
    for module in modules:
        for name in module.__all__:
            found = getattr(module, name)
            public.add(str(Path(inspect.getsourcefile(found)).relative_to(ROOT)))
    assert "bash .ci/lint" in (ROOT / ".ci/run").read_text(), ".ci/run no longer runs .ci/lint"
    lint = (ROOT / ".ci/lint").read_text()
    checked = set(re.findall(r"^\s+(hf_lowzero/\S+\.py)", lint.split("--select D", 1)[1], re.M))
    assert public <= checked, f"add to .ci/lint's docstring check: {sorted(public - checked)}"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs site, built once for the tests that read its pages."""
    out = tmp_path_factory.mktemp("site")
    subprocess.run(["mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)], cwd=ROOT, check=True)
    return out


def test_no_markup_shows_through_on_any_page(site):
    """Every page of the built site, as a browser shows its text: no literal code fence, ``**``, table
    rule, HTML comment or list item run into a paragraph (``tools/check_docs_rendered.py`` does the
    same in a real browser, with screenshots and the pictures drawn)."""
    from tools.check_docs_rendered import problems

    pages = [p for p in site.glob("**/index.html") if "results" not in p.relative_to(site).parts]
    assert len(pages) > 15
    found = {str(p.relative_to(site)): [f for f in problems(p.read_text()) if "not drawn" not in f] for p in pages}
    assert {page: f for page, f in found.items() if f} == {}
    assert problems("<p>the default 2**16 overflows</p>") != []  # it sees what it looks for
    assert problems("<p>counted apart. - <strong>What runs.</strong> Stages 1 and 2</p>") != []


def test_the_api_reference_shows_every_public_name(site):
    """mkdocstrings leaves out, without a word, a member it cannot find by reading the source: until
    the package names were imported under ``if TYPE_CHECKING:`` (``hf_lowzero/lazy_names.py``), the
    reference lacked ``LowZeroTrainer``, ``LowZeroTrainingArguments``, ``with_zero`` and ``plan_memory``."""
    pytest.importorskip("ray")
    pages = {"hf_lowzero": "hf_lowzero", "ray": "hf_lowzero.ray", "clm_ray": "hf_lowzero.recipes.clm_ray"}
    for page, package in pages.items():
        html = (site / "api" / page / "index.html").read_text()
        names = importlib.import_module(package).__all__
        assert [n for n in names if f'id="{package}.{n}"' not in html] == [], f"docs/api/{page}.md"


# ------------------------------------------------------------------ reading


PARAGRAPH_WORDS = 80  # a paragraph past 80 words wants a list, a table or a heading
NOT_YET_REWRITTEN: set[str] = set()  # pages not rewritten for reading yet: none left


def _paragraphs(text: str) -> list[str]:
    """The running text of a page: its blocks between blank lines, less code blocks, HTML comments,
    tables, lists (and what is indented under them), headings and quotes."""
    text = re.sub(r"<!--.*?-->", "", FENCE.sub("", text), flags=re.S)
    found = []
    for block in re.split(r"\n[ \t]*\n", text):
        if block.strip() and not re.match(r"(\s*(\||[-*+] |\d+\. |#|>)| {2,}\S)", block):
            found.append(" ".join(block.split()))
    return found


def test_no_guide_has_a_paragraph_too_long_to_read():
    too_long = {}
    for path in doc_files():
        page = str(path.relative_to(ROOT))
        longest = max(_paragraphs(path.read_text()), key=lambda p: len(p.split()), default="")
        if page in NOT_YET_REWRITTEN:
            assert len(longest.split()) > PARAGRAPH_WORDS, f"{page} reads well now: take it off NOT_YET_REWRITTEN"
        elif len(longest.split()) > PARAGRAPH_WORDS:
            too_long[page] = f"{len(longest.split())} words: {longest[:80]}..."
    assert not too_long, f"paragraphs over {PARAGRAPH_WORDS} words (split them, or make a list or a table): {too_long}"
    long = " ".join(["word"] * (PARAGRAPH_WORDS + 1))
    assert _paragraphs(f"# Title\n\n{long}\n") == [long]  # it sees what it looks for
    assert _paragraphs(f"- {long}\n\n| a | {long} |\n\n```\n{long}\n```\n\n<!-- {long} -->\n") == []
