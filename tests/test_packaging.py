"""The built wheel (not just the editable install) contains every module and the
built-in plugins' entry points: setuptools' package-dir mapping lists sub-packages by hand."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"core": "pagelm", "backends": "pagelm.backends", "plugins": "pagelm.plugins", "models": "pagelm.models"}


def module_name(prefix: str, relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


@pytest.mark.slow
def test_wheel_installs_and_imports_every_module(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(ROOT)],
        check=True,
    )
    (wheel,) = wheel_dir.glob("pagelm-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], check=True
    )
    source_modules = sorted(
        module_name(prefix, p.relative_to(ROOT / folder))
        for folder, prefix in FOLDERS.items()
        for p in (ROOT / folder).rglob("*.py")
    )
    script = textwrap.dedent(
        f"""
        import importlib, importlib.metadata, pagelm
        assert pagelm.__file__.startswith({str(site)!r}), pagelm.__file__
        for name in {source_modules!r}:
            importlib.import_module(name)
        dist = importlib.metadata.distribution("pagelm")
        eps = {{ep.name for ep in dist.entry_points if ep.group == "pagelm.plugins"}}
        assert {{"torch_attention", "fcfs", "models"}} <= eps, eps
        print(len({source_modules!r}))
        """
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == len(source_modules)
