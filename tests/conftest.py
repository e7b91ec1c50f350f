"""Shared fixtures: tiny random Hugging Face model directories built locally (no hub)."""

import gc

import pytest
import torch

from pagelm.models.testing import build_tiny_model


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(model_root):
    return build_tiny_model(model_root / "llama", "llama")


@pytest.fixture(scope="session")
def make_model(model_root):
    """make_model(name, arch, **kw) -> directory, built once per session per name."""
    built = {}

    def make(name, arch, **kw):
        if name not in built:
            built[name] = build_tiny_model(model_root / name, arch, **kw)
        return built[name]

    return make


@pytest.fixture(autouse=True)
def free_gpu(request):
    """GPU tests: every LLM sizes its KV pool from what is free, so drop the previous tests'
    engines before and after each one."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
