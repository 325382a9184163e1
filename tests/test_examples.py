"""Every script in `examples/` and every ```python block of README.md and of `DOC_PAGES` runs, as a user would run
it.

Each runs in a fresh subprocess from a temporary directory (not the repository root), with the checkout's
`reshard` on `PYTHONPATH`, so a snippet that stops working, or works only from the repository, fails here.

README and page blocks: a block whose first line is `# torchrun --nproc-per-node N` runs under torchrun with N ranks; a
block that must not run says so on its first line, `# not run: <reason>`, and is reported as skipped with that
reason. A block whose first line is `# excerpt of examples/NAME.py` shows part of an example (which runs here
itself): each of its lines must be a line of that example, in order. Every other block runs with `python`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
TIMEOUT_S = 900  # generous: several ranks start on a loaded 2-core machine
TORCHRUN = re.compile(r"^#\s*torchrun\s+--nproc-per-node[ =](\d+)\s*$")
NOT_RUN = re.compile(r"^#\s*not run:\s*(\S.*)$")
EXCERPT = re.compile(r"^#\s*excerpt of (examples/[\w.]+\.py)\s*$")

# what each example prints when it checked its own result, and the arguments that keep it short
EXPECTED = {
    "plan_one_tensor.py": r"^plan verified: network 96 B \(lower bound 96 B\)",
    "dtensor_two_groups.py": r"^dtensor_two_groups verified on 4 ranks$",
    "refit_model.py": r"^refit_model verified: 4 weights",
    "refit_demo.py": r"^demo verified$",
    "fsdp_tp_refit.py": r"^fsdp_tp_refit verified",
    "vllm_refit.py": r"^vllm_refit verified",
    "ray_refit.py": r"^ray_refit verified",
    "megatron_refit.py": r"^megatron_refit verified",
    "trl_grpo.py": r"^trl_grpo verified",
}
# examples another test module runs, with what they need around them
RUN_ELSEWHERE = {"trl_grpo.py": "tests/integrations/test_trl.py (under accelerate, against its module's `vllm serve` server)"}
# examples that need an optional package; the vLLM one runs in `make test-vllm`'s environment (marker `vllm`), the
# Ray one in the same environment with Ray added (`make test-frameworks`, marker `frameworks`)
NEEDS = {"fsdp_tp_refit.py": "transformers", "vllm_refit.py": "vllm", "ray_refit.py": "vllm",
         "megatron_refit.py": "megatron.core"}  # megatron: in `make test-megatron`'s environment (marker megatron)
FRAMEWORKS = {"ray_refit.py": "ray"}
ARGS = {"refit_demo.py": ["--layers", "2"]}
# the examples of 15 s or more in the core environment (seconds measured with -n 1 at load 17-29, docs/testing.md):
# several interpreters that each import torch (and transformers); `make test-fast` leaves them out, as it does the
# README's torchrun blocks (README.md:65, 4 ranks: 48 s)
SLOW = {"fsdp_tp_refit.py": 97, "refit_demo.py": 50, "dtensor_two_groups.py": 32}


def run_script(path: Path, cwd: Path, *, nproc: int | None = None, args: tuple[str, ...] = ()) -> str:
    """Run `path` (under torchrun with `nproc` ranks if given) from `cwd`; its output, asserting exit status 0."""
    env = dict(os.environ)
    # first: the vLLM CPU workaround every process of the run applies at start (tests/amx_permission/sitecustomize.py)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "amx_permission"), str(REPO),
                                         *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(path), *args]
    if nproc is not None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(path), *args]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-6000:]}"
    return r.stdout


def torchrun_ranks(text: str) -> int | None:
    """N from a `torchrun --nproc-per-node N` in an example's docstring: how it must be started."""
    m = re.search(r"torchrun --nproc-per-node (\d+)", text)
    return int(m.group(1)) if m else None


def readme_blocks(path: Path = REPO / "README.md") -> list[tuple[int, str]]:
    """`(line number, code)` of every ```python block of `path`."""
    blocks, current, start = [], None, 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if current is None and line.strip() == "```python":
            current, start = [], i + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_every_example_declares_its_check() -> None:
    assert sorted(p.name for p in EXAMPLES) == sorted(EXPECTED)


def _marks(name: str) -> list[pytest.MarkDecorator]:
    if name in SLOW:
        return [pytest.mark.slow]
    if name in FRAMEWORKS:
        return [pytest.mark.frameworks]
    if NEEDS.get(name) == "megatron.core":
        return [pytest.mark.megatron]
    return [pytest.mark.vllm] if NEEDS.get(name) == "vllm" else []


@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p.name)) for p in EXAMPLES
                                  if p.name not in RUN_ELSEWHERE],
                         ids=[p.name for p in EXAMPLES if p.name not in RUN_ELSEWHERE])
def test_example_runs_and_verifies(path: Path, tmp_path: Path) -> None:
    for need in filter(None, (NEEDS.get(path.name), FRAMEWORKS.get(path.name))):
        pytest.importorskip(need, reason=f"{path.name} needs {need}")
    text = path.read_text()
    assert 'if __name__ == "__main__":' in text, f"{path.name} needs a __main__ guard"
    out = run_script(path, tmp_path, nproc=torchrun_ranks(text), args=tuple(ARGS.get(path.name, ())))
    assert re.search(EXPECTED[path.name], out, re.M), f"{path.name} did not print its verification:\n{out[-3000:]}"


def excerpt_missing(code: str, source: str) -> str | None:
    """The first line of an excerpt block (after its marker) that is not, in order, a line of `source`; None if
    all are. Blank lines and `...` (elided code) are skipped; indentation is not compared."""
    lines = iter(s.strip() for s in source.splitlines())
    for want in (s.strip() for s in code.splitlines()[1:]):
        if want and want != "..." and not any(want == have for have in lines):
            return want
    return None


DOC_PAGES = ["README.md", "docs/custom-trainers.md", "docs/adding-an-engine.md"]
"""The pages whose every ```python block runs here (the others show fragments of what the examples run)."""
BLOCKS = [(page, n, code) for page in DOC_PAGES for n, code in readme_blocks(REPO / page)]


@pytest.mark.parametrize("page,line,code", [
    pytest.param(page, n, code, marks=[pytest.mark.slow] if TORCHRUN.match(code.splitlines()[0] if code.strip()
                                                                             else "") else [])
    for page, n, code in BLOCKS], ids=[f"{page}:{n}" for page, n, _ in BLOCKS])
def test_readme_block_runs(page: str, line: int, code: str, tmp_path: Path) -> None:
    first = code.splitlines()[0] if code.strip() else ""
    excerpt = EXCERPT.match(first)
    if excerpt:  # the example runs in test_example_runs_and_verifies; here its lines must be the example's
        missing = excerpt_missing(code, (REPO / excerpt.group(1)).read_text())
        assert missing is None, f"{page}:{line}: {missing!r} is not (in this order) in {excerpt.group(1)}"
        return
    skip = NOT_RUN.match(first)
    if skip:
        pytest.skip(f"{page}:{line}: {skip.group(1)}")
    ranks = TORCHRUN.match(first)
    script = tmp_path / f"block_{Path(page).stem}_{line}.py"
    script.write_text(code)
    run_script(script, tmp_path, nproc=int(ranks.group(1)) if ranks else None)


def test_readme_markers_are_honoured(tmp_path: Path) -> None:
    """The block runner itself: a failing block fails, a torchrun block gets its ranks, `# not run` needs a reason."""
    bad = tmp_path / "bad.py"
    bad.write_text("print(undefined_name)\n")
    with pytest.raises(AssertionError, match="NameError"):
        run_script(bad, tmp_path)
    ranks = tmp_path / "ranks.py"
    # one write per rank (a pipe takes a short write whole): `print('world', n)` writes its parts one by one, and
    # two ranks' parts interleaved ('worldworld 2\n 2\n') in one fresh-clone run
    ranks.write_text("import os, sys\nsys.stdout.write(f\"world {os.environ['WORLD_SIZE']}\\n\")\n")
    assert run_script(ranks, tmp_path, nproc=2).count("world 2") == 2
    assert TORCHRUN.match("# torchrun --nproc-per-node 4").group(1) == "4"
    assert NOT_RUN.match("# not run: needs 8 GPUs").group(1) == "needs 8 GPUs"
    assert NOT_RUN.match("# not run:") is None  # a reason is required
    assert EXCERPT.match("# excerpt of examples/fsdp_tp_refit.py").group(1) == "examples/fsdp_tp_refit.py"
    source = "a = 1\nb = 2\nc = 3\n"
    assert excerpt_missing("# excerpt\na = 1\n...\nc = 3\n", source) is None
    assert excerpt_missing("# excerpt\nc = 3\na = 1\n", source) == "a = 1"  # out of order
    assert excerpt_missing("# excerpt\nd = 4\n", source) == "d = 4"
