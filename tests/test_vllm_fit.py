"""tools/vllm_fit.py's logic on stored resolver output (uv pip compile, read from PyPI on
2026-11-29: requirements-vllm.txt without vllm and with vllm 0.31.0, 0.32.0 and 0.33.0; the old
set, requirements-gpu.txt, alone and with 0.26.0, 0.30.0 and 0.33.0) and stored upload dates: a
window fits only when each release in it resolves with the set, keeps its torch and transformers,
and came out after both. The live check needs PyPI and uv: `python -m tools.vllm_fit`."""
import json
from pathlib import Path

from packaging.specifiers import SpecifierSet

from engines import vllm_startup
from tools import vllm_fit

STORED = Path(__file__).parent / "fixtures/vllm_fit"
DATES = json.loads((STORED / "dates.json").read_text())


def stored(prefix: str, like: str):
    """resolve() over the stored outputs named prefix[-vllm-X]; a release without one is taken to
    resolve as `like` does."""
    def resolve(extra: list[str]) -> tuple[dict | None, str]:
        name = prefix + (f"-{extra[0].replace('==', '-')}" if extra else "")
        if (STORED / f"{name}.err").exists():
            return None, vllm_fit.reason((STORED / f"{name}.err").read_text())
        path = STORED / f"{name}.txt"
        return vllm_fit.pins((path if path.exists() else STORED / f"{like}.txt").read_text()), ""
    return resolve


def test_the_set_fits_its_window_with_the_transformers_vllm_declares_and_tested():
    problems, sets = vllm_fit.check(vllm_fit.window(), DATES, stored("set", "set-vllm-0.32.0"))
    assert problems == [] and list(sets) == ["0.32.0"]
    assert sets["0.32.0"]["torch"] == "2.13.0" and sets["0.32.0"]["transformers"] == "5.19.0"
    assert vllm_fit.cuda_build(sets["0.32.0"]) == \
        "CUDA 13.0 (cuda-toolkit 13.0.3.0, nvidia-cuda-runtime 13.0.96)"


def test_a_window_widened_to_0_31_fails_on_vllms_declared_transformers():
    problems, _ = vllm_fit.check(SpecifierSet(">=0.31.0,<0.33.0"), DATES,
                                 stored("set", "set-vllm-0.32.0"))
    assert problems == ["vllm==0.31.0 does not install with requirements-vllm.txt: Because "
                        "vllm==0.31.0 depends on transformers>=5.10.4,<5.18.0 and you require "
                        "transformers==5.19.0, we can conclude that your requirements and "
                        "vllm==0.31.0 are incompatible."]
    newer, _ = vllm_fit.check(SpecifierSet(">=0.32,<0.34"), DATES, stored("set", "set-vllm-0.32.0"))
    assert newer and "vllm>=0.33.0 depends on torch==2.14.0" in newer[0]


def test_the_old_window_fails_vllm_never_tested_the_trainers_transformers():
    """Issue 57: requirements-gpu.txt with vLLM 0.27-0.30 resolves (they declare transformers with
    no upper bound) but transformers 5.23.0 came out after each of them."""
    problems, sets = vllm_fit.check(SpecifierSet(">=0.27.0,<0.31.0"), DATES,
                                    stored("gpu", "gpu-vllm-0.30.0"))
    assert sets == {} and len(problems) == 5
    assert problems[-1] == ("vllm==0.30.0 (2026-09-22) came out before transformers 5.23.0 "
                            "(2026-11-13): a pairing it never tested; pin the transformers its "
                            "release tested")
    older, _ = vllm_fit.check(SpecifierSet(">=0.26,<0.27"), DATES, stored("gpu", "gpu-vllm-0.30.0"))
    assert older == ["vllm==0.26.0 changes torch 2.13.0 -> 2.11.0"]
    assert vllm_fit.check(SpecifierSet(">=0.40"), DATES, stored("set", "set-vllm-0.32.0"))[0] == [
        "no vllm release in the window >=0.40"]


def test_it_says_what_the_set_does_to_the_torch_installed_here():
    got = vllm_fit.pins((STORED / "set-vllm-0.32.0.txt").read_text())
    cuda = "torch 2.13.0 built for CUDA 13.0 (cuda-toolkit 13.0.3.0, nvidia-cuda-runtime 13.0.96)"
    assert vllm_fit.what_it_does(got, "2.11.0+cu130") == \
        f"installing it pulls {cuda}, replacing the torch installed here (2.11.0+cu130)"
    assert vllm_fit.what_it_does(got, "2.13.0").endswith("keeping the torch installed here "
                                                         "(2.13.0)")
    assert vllm_fit.what_it_does(got, None) == f"installing it pulls {cuda}"
    assert vllm_fit.cuda_build({"torch": "2.13.0"}) == "no CUDA packages"


def test_release_candidates_are_not_in_the_window_and_names_are_canonical():
    versions = [*DATES["vllm"], "0.32.1rc1"]
    assert "0.32.1rc1" not in vllm_fit.releases_in(SpecifierSet(">=0.32"), versions)
    assert vllm_fit.pins("Torch==2.13.0\nnvidia_cudnn-cu13==9.1\n# x==1\nrich[x]==15.0.0 ; y") \
        == {"torch": "2.13.0", "nvidia-cudnn-cu13": "9.1", "rich": "15.0.0"}


def test_the_requirements_window_is_the_one_the_trainer_accepts():
    spec = vllm_fit.window()
    assert str(spec) == str(SpecifierSet(f">={vllm_startup.MIN_VLLM},<{vllm_startup.NEXT_VLLM}"))


def test_the_set_is_the_gpu_sets_pins_but_torch_and_transformers():
    """requirements-vllm.txt repeats requirements-gpu.txt's pins (pip cannot override a pin it
    includes), but for the torch vLLM pins and the transformers it declares and tested."""
    gpu = vllm_fit.pins((vllm_fit.ROOT / "requirements-gpu.txt").read_text())
    mine = vllm_fit.pins(vllm_fit.SET.read_text())
    keep = ("torch", "transformers")
    assert {k: v for k, v in mine.items() if k not in keep} == \
        {k: v for k, v in gpu.items() if k not in keep}
    assert mine["torch"] == "2.13.0" and mine["transformers"] == "5.19.0"
    assert vllm_fit.differing() == {"transformers": "5.19.0"}
    assert len(vllm_fit.without_vllm()) == len(mine)


def test_installed_pins_are_checked_with_their_requirements(monkeypatch):
    from importlib import metadata
    versions = {"transformers": "5.19.0", "tokenizers": "0.23.3", "huggingface-hub": "0.30.0"}

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]
    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(metadata, "requires", lambda name: [
        "tokenizers<0.24.0,>=0.23.1", "huggingface-hub<3.0,>=1.31.0", "regex>=2025.10.22",
        "pytest; extra == 'testing'"])
    assert vllm_fit.not_as_pinned({"transformers": "5.19.0"}) == [
        "transformers 5.19.0 needs huggingface-hub<3.0,>=1.31.0, found 0.30.0",
        "transformers 5.19.0 needs regex>=2025.10.22, found none"]
    assert vllm_fit.not_as_pinned({"transformers": "5.23.0"}) == [
        "transformers 5.19.0 is found first, not 5.23.0"]


def test_the_pins_ci_installs_over_the_trainers_venv(capsys):
    assert vllm_fit.main(["--pins"]) == 0
    assert capsys.readouterr().out.split() == ["transformers==5.19.0"]
