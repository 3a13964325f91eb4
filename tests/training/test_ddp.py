"""Beyond one process: DDP and FSDP2 (``fully_shard``) with LoRA, 2 CPU processes on loopback (gloo).

Each test spawns two ranks that train the same LoRA model (with a fully trained ``modules_to_save`` head)
on their halves of every batch, then writes what it trained; the parent checks the ranks agree with each
other and with a single process trained on the whole batches, and that rank 0 alone saved the adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

import loragen
from loragen.training.distributed import save_adapter_main_process, unwrap_model, wrap_ddp
from loragen.training.optimizers import make_optimizer

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD_SIZE = 2
STEPS = 4
LR = 1e-2
# a hang fails after this long; generous, because a loaded 2-core machine can take minutes to spawn and
# import two ranks (90 s was once too short there while the ranks were fine)
TIMEOUT_S = 600
STEP_TIMEOUT_S = 300  # one rendezvous or collective


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _lora_model() -> Classifier:
    torch.manual_seed(0)
    config = loragen.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"], modules_to_save=["head"])
    return loragen.get_lora_model(Classifier(), config)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 12, generator=generator), torch.randint(0, 5, (16,), generator=generator)


def _trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for name, param in unwrap_model(model).named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2 DTensor
            state[name] = full.detach().cpu().clone()
    return state


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int | None, micro_batches: int = 1
) -> None:
    """STEPS steps; with a rank, each process takes its half of every batch (the single run takes all).

    With ``micro_batches > 1`` each half is split further and gradients accumulate, DDP's all-reduce
    skipped (``no_sync``) on all but the last micro-batch.
    """
    for step in range(STEPS):
        inputs, labels = _batch(step)
        if rank is not None:
            inputs, labels = inputs.chunk(WORLD_SIZE)[rank], labels.chunk(WORLD_SIZE)[rank]
        optimizer.zero_grad()
        pieces = list(zip(inputs.chunk(micro_batches), labels.chunk(micro_batches)))
        for index, (piece_inputs, piece_labels) in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last or micro_batches == 1 else model.no_sync():
                (F.cross_entropy(model(piece_inputs), piece_labels) / micro_batches).backward()
        optimizer.step()


def _run_ddp(rank: int, out: Path) -> dict[str, str]:
    returned = {}
    for name, eight_bit, micro_batches in (
        ("fp32", False, 1),
        ("eight_bit", True, 1),
        ("accumulate", False, 2),
    ):
        model = _lora_model()
        # find_unused_parameters=False: DDP would raise at step 2 if a trained tensor got no gradient
        ddp = wrap_ddp(model)
        if eight_bit:
            optimizer = make_optimizer(model, lr=LR, eight_bit=True, min_8bit_size=0)
        else:
            optimizer = make_optimizer(model, lr=LR)
        _train(ddp, optimizer, rank, micro_batches)
        save_file(_trained_state(ddp), str(out / f"{name}-rank{rank}.safetensors"))
        returned[name] = str(save_adapter_main_process(ddp, out / f"adapter-{name}"))
    # A save that fails on rank 0 raises there, and on the other ranks instead of leaving them waiting.
    (out / "a-file").write_text("not a folder")
    try:
        save_adapter_main_process(ddp, out / "a-file")
        returned["failed_save"] = ""
    except Exception as exc:
        returned["failed_save"] = f"{type(exc).__name__}: {exc}"
    return returned


def _run_fsdp2(rank: int, out: Path) -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard

    model = _lora_model()
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, make_optimizer(model, lr=LR), rank)
    save_file(_trained_state(model), str(out / f"fsdp-rank{rank}.safetensors"))
    returned = {"fsdp": str(save_adapter_main_process(model, out / "adapter-fsdp"))}
    # FSDP2 warns when a module's forward returns a view (of a custom Function's output); LoRA's must not
    returned["view_warnings"] = json.dumps([str(w.message) for w in caught if "view" in str(w.message)])
    try:  # the gradients of the last step are still there
        make_optimizer(model, lr=LR, eight_bit=True, min_8bit_size=0).step()
        returned["eight_bit_error"] = ""
    except TypeError as exc:
        returned["eight_bit_error"] = str(exc)
    return returned


def _worker(rank: int, store_port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    # the rendezvous store lives in the parent, which outlives both ranks: a rank never loses the store
    # while the other still talks to it (with the store in rank 0, rank 1 could, and abort with
    # "terminate called without an active exception")
    # a rank starved of CPU on a loaded 2-core machine may reach a collective minutes after the other: the
    # store's and the group's timeouts stay under the hang deadline but far above a healthy run's seconds
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=STEP_TIMEOUT_S))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=STEP_TIMEOUT_S)
    )
    out = Path(out_dir)
    try:
        returned = _run_ddp(rank, out)
        if _has_fully_shard():
            returned.update(_run_fsdp2(rank, out))
        (out / f"returned-rank{rank}.json").write_text(json.dumps(returned))
        dist.barrier()  # neither rank tears down the group while the other still uses it
    finally:
        dist.destroy_process_group()


def _has_fully_shard() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Spawn the two ranks once (DDP runs, then FSDP2); returns the folder they wrote to."""
    out_dir = tmp_path_factory.mktemp("distributed")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # port 0: the operating system picks a free port while the store binds it (no window for another
    # process to take a port chosen in advance)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STEP_TIMEOUT_S)
    )
    context = mp.start_processes(
        _worker, args=(store.port, str(out_dir)), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD_SIZE} ranks did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
        del store
    return out_dir


def _single_process(eight_bit: bool = False) -> tuple[Classifier, dict[str, torch.Tensor]]:
    model = _lora_model()
    optimizer = (
        make_optimizer(model, lr=LR, eight_bit=True, min_8bit_size=0)
        if eight_bit
        else make_optimizer(model, lr=LR)
    )
    _train(model, optimizer, rank=None)
    return model, _trained_state(model)


def _assert_close_states(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance: float
) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name, **tolerance)


def _assert_saved_once(out_dir: Path, name: str, reference: Classifier) -> None:
    returned = [json.loads((out_dir / f"returned-rank{r}.json").read_text())[name] for r in range(WORLD_SIZE)]
    assert returned == [str(out_dir / f"adapter-{name}"), "None"]
    leftovers = [p.name for p in out_dir.iterdir() if p.name.startswith(".")]  # atomic writes' temporaries
    assert leftovers == []
    # The saved adapter, loaded into a fresh base, computes what the single-process model computes.
    torch.manual_seed(0)
    fresh = loragen.load_adapter(Classifier(), out_dir / f"adapter-{name}")
    inputs = _batch(99)[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh(inputs), reference(inputs), rtol=1e-5, atol=1e-5)


def test_ddp_two_ranks_match_each_other_and_a_single_process(distributed_run: Path) -> None:
    tmp_path = distributed_run
    for name, eight_bit in (("fp32", False), ("eight_bit", True), ("accumulate", False)):
        rank0 = load_file(str(tmp_path / f"{name}-rank0.safetensors"))
        rank1 = load_file(str(tmp_path / f"{name}-rank1.safetensors"))
        assert set(rank0) == {
            "fc1.lora_A",
            "fc1.lora_B",
            "fc2.lora_A",
            "fc2.lora_B",
            "head.weight",
            "head.bias",
        }
        for key in rank0:
            assert torch.equal(rank0[key], rank1[key]), f"{name}: {key} differs between ranks"
        reference, expected = _single_process(eight_bit)
        # Gradients are averaged in a different order than one process sums them: rounding-level differences,
        # which the 8-bit states can round to a neighbouring code.
        _assert_close_states(rank0, expected, rtol=1e-4, atol=1e-5 if not eight_bit else 1e-4)
        if not eight_bit:
            _assert_saved_once(tmp_path, name, reference)


def test_a_failed_save_on_rank_0_raises_on_every_rank(distributed_run: Path) -> None:
    rank0, rank1 = (json.loads((distributed_run / f"returned-rank{r}.json").read_text()) for r in range(2))
    assert rank0["failed_save"].startswith("AdapterError") and "is not a folder" in rank0["failed_save"]
    assert rank1["failed_save"].startswith("TrainingSetupError: save_adapter_main_process: rank 0 failed")
    assert "is not a folder" in rank1["failed_save"]


def test_fsdp2_fully_shard_with_lora_matches_a_single_process(distributed_run: Path, tmp_path: Path) -> None:
    if not _has_fully_shard():
        pytest.skip("this torch has no FSDP2 fully_shard")
    out_dir = distributed_run
    rank0 = load_file(str(out_dir / "fsdp-rank0.safetensors"))
    rank1 = load_file(str(out_dir / "fsdp-rank1.safetensors"))
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    reference, expected = _single_process()
    _assert_close_states(rank0, expected, rtol=1e-4, atol=1e-5)
    _assert_saved_once(out_dir, "fsdp", reference)
    for rank in range(WORLD_SIZE):
        returned = json.loads((out_dir / f"returned-rank{rank}.json").read_text())
        assert json.loads(returned["view_warnings"]) == []
    refused = json.loads((out_dir / "returned-rank0.json").read_text())["eight_bit_error"]
    assert "AdamW8bit does not support sharded (DTensor) parameters" in refused
    # Rank 0 wrote the same keys and values that save_adapter writes for the single-process model.
    loragen.save_adapter(reference, tmp_path / "single")
    saved = load_file(str(out_dir / "adapter-fsdp" / "adapter_model.safetensors"))
    single = load_file(str(tmp_path / "single" / "adapter_model.safetensors"))
    _assert_close_states(saved, single, rtol=1e-4, atol=1e-5)
    assert json.loads((out_dir / "adapter-fsdp" / "adapter_config.json").read_text()) == json.loads(
        (tmp_path / "single" / "adapter_config.json").read_text()
    )


def test_process_group_is_not_pinned_by_default_arguments(tmp_path: Path) -> None:
    """Importing loragen's distributed helpers first keeps torch.distributed.nn's ``group=WORLD`` defaults
    empty, so the default group dies with destroy_process_group and not at interpreter exit (where its
    teardown raced gloo's threads: the "terminate called without an active exception" aborts)."""
    script = tmp_path / "pinned.py"
    script.write_text(
        "import inspect\n"
        "import loragen.training.distributed\n"
        "import torch.distributed as dist\n"
        "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
        "import torch.distributed.nn.functional as functional\n"
        "print(inspect.signature(functional.broadcast).parameters['group'].default)\n"
        "dist.destroy_process_group()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
