"""tools/vllm_fit.py's logic on stored resolver output (uv pip compile of requirements-gpu.txt
alone and with vllm 0.26.0, 0.30.0 and 0.33.0, read from PyPI on 2026-11-28): a window fits only
when every release in it keeps the GPU set's torch and transformers. The live check needs PyPI and
uv: `python -m tools.vllm_fit`."""
from pathlib import Path

from packaging.specifiers import SpecifierSet

from engines import vllm_startup
from tools import vllm_fit

STORED = Path(__file__).parent / "fixtures/vllm_fit"
VERSIONS = ["0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
            "0.32.0", "0.33.0", "0.31.0rc1"]


def stored_resolve(extra: list[str]) -> tuple[dict | None, str]:
    """The stored outputs; a release without one is taken to resolve as 0.30.0 does."""
    name = extra[0].replace("==", "-") if extra else "gpu"
    if (STORED / f"{name}.err").exists():
        return None, vllm_fit.reason((STORED / f"{name}.err").read_text())
    path = STORED / f"{name}.txt"
    return vllm_fit.pins((path if path.exists() else STORED / "vllm-0.30.0.txt").read_text()), ""


def test_the_stored_resolutions_keep_torch_and_transformers_only_inside_the_window():
    gpu, fit = (vllm_fit.pins((STORED / n).read_text()) for n in ("gpu.txt", "vllm-0.30.0.txt"))
    assert gpu["torch"] == fit["torch"] == "2.13.0" and fit["vllm"] == "0.30.0"
    assert gpu["transformers"] == fit["transformers"] == "5.23.0"
    assert vllm_fit.check(vllm_fit.window(), VERSIONS, stored_resolve) == []


def test_a_window_that_reaches_a_release_with_another_torch_or_no_solution_fails():
    older = vllm_fit.check(SpecifierSet(">=0.26,<0.31"), VERSIONS, stored_resolve)
    assert older == ["vllm==0.26.0 changes torch 2.13.0 -> 2.11.0"]
    newer = vllm_fit.check(SpecifierSet(">=0.33"), VERSIONS, stored_resolve)
    assert newer == ["vllm==0.33.0 does not install with requirements-gpu.txt: Because "
                     "vllm>=0.33.0 depends on torch==2.14.0 and you require torch>=2.6,<2.14, we "
                     "can conclude that your requirements and vllm>=0.33.0 are incompatible."]
    assert vllm_fit.check(SpecifierSet(">=0.40"), VERSIONS, stored_resolve) == [
        "no vllm release in the window >=0.40"]


def test_release_candidates_are_not_in_the_window_and_names_are_canonical():
    assert "0.31.0rc1" not in vllm_fit.releases_in(SpecifierSet(">=0.27"), VERSIONS)
    assert vllm_fit.pins("Torch==2.13.0\nnvidia_cudnn-cu13==9.1\n# x==1\nrich[x]==15.0.0 ; y") \
        == {"torch": "2.13.0", "nvidia-cudnn-cu13": "9.1", "rich": "15.0.0"}


def test_the_requirements_window_is_the_one_the_trainer_accepts():
    spec = vllm_fit.window()
    assert str(spec) == str(SpecifierSet(f">={vllm_startup.MIN_VLLM},<{vllm_startup.NEXT_VLLM}"))
    assert "-r requirements-gpu.txt" in (vllm_fit.ROOT / "requirements-vllm.txt").read_text()
