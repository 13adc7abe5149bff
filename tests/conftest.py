"""Shared fixtures: each pipeline test works on its own copy of the project, as a user would.

`built` builds tiny once per session; tests that mutate take a copy of that built
project (store included) so they start from a warm store without rebuilding.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def project_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def copy_project(dest: Path) -> Path:
    for rel in project_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


@dataclass
class Run:
    rc: int
    out: str
    seconds: float

    @property
    def ran(self) -> list[str]:
        """Tasks doit executed (its '.  task' lines), e.g. ['shards:tiny', ...]."""
        return [line[3:].strip() for line in self.out.splitlines() if line.startswith(".  ")]

    def stages_ran(self, recipe="tiny") -> set[str]:
        """Stages that built (the check action that runs before training is not a stage)."""
        return {t.split(":")[0] for t in self.ran if t.endswith(f":{recipe}")} - {"check"}


# Builds must not touch the network: every request goes to a proxy that is not there.
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
              "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
              "NO_PROXY": "", "no_proxy": ""}


# Every stage in doit's own process unless a test says otherwise (test_preload.py does), so the suite
# runs alike on 2 CPUs and on 16, where each build that trains would otherwise import Quark beside it
IN_PROCESS = {"MINDXTRAIN_PRELOAD": "never"}


def doit(project: Path, *args, env=None, timeout=900) -> Run:
    start = time.time()
    p = subprocess.run([sys.executable, "-m", "doit", *args], cwd=project, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **NO_NETWORK, **IN_PROCESS, **(env or {})})
    return Run(p.returncode, p.stdout + p.stderr, time.time() - start)


def snapshot(project: Path) -> dict[str, tuple]:
    """Every file under artifacts/store and the pointers, with size and mtime: 'nothing changed'
    checks. (Not the caches, nor artifacts/locks/: empty files whose flocks say who builds what.)"""
    art = project / "artifacts"
    return {str(p.relative_to(art)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in art.rglob("*") if p.is_file() and p.name not in ("statcache.sqlite", "doit.sqlite")
            and "-journal" not in p.name and p.relative_to(art).parts[0] != "locks"}


ALL_STAGES = {"base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest"}


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    project = copy_project(tmp_path_factory.mktemp("built"))
    run = doit(project, "manifest:tiny", env={"PYTHONHASHSEED": "1"})  # in doit's process: test_preload compares
    assert run.rc == 0, run.out[-3000:]
    assert run.stages_ran() == ALL_STAGES
    return project


def copy_built(built: Path, parent: Path) -> Path:
    """A private copy of the built project, store and all, at parent/proj."""
    dest = parent / "proj"
    shutil.copytree(built, dest, symlinks=True)
    return dest


@pytest.fixture
def warm(built, tmp_path) -> Path:
    """A private copy of the built project, store and all."""
    return copy_built(built, tmp_path)


def build_beside(built: Path, tmp_path_factory, recipe: str) -> tuple[Path, Run]:
    """A copy of the built project (tiny in its store) with `recipe` built too (hash seed 1):
    for module fixtures of recipes that share tiny's early stages."""
    project = copy_built(built, tmp_path_factory.mktemp(recipe))
    return project, doit(project, f"manifest:{recipe}", env={"PYTHONHASHSEED": "1"})


@pytest.fixture(scope="module")
def model_and_tok():
    """A small random Qwen3 in fp32 on the CPU and the tiny model's character tokenizer: the
    generation engine's and the eval stage's wide batches' tests compare answers on it."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from stages.model.tiny import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tok


@pytest.fixture
def fresh(tmp_path) -> Path:
    """A private copy of the project with an empty store."""
    return copy_project(tmp_path / "fresh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_url():
    """moto's S3 server on 127.0.0.1 (as s3fs's own tests use it): an offline S3 for the remote cache."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
