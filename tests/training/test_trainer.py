"""``LoraTrainerCallback`` with transformers' Trainer and TRL's SFTTrainer: every checkpoint holds the peft
adapter and, by default, nothing of the frozen base; the adapter loads in peft, and
``resume_from_checkpoint`` continues exactly where an uninterrupted run would be (parameters and losses),
with adapter-only checkpoints and with ``full_model=True`` ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import loragen
from loragen import LoraConfig

transformers = pytest.importorskip("transformers")

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return loragen.get_lora_model(transformers.LlamaForCausalLM(config), CONFIG)


def _dataset(n: int = 16) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, 64, (12,), generator=g).tolist() for _ in range(n)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def _args(output_dir: Path, max_steps: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=max_steps,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
    )


def _lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def _train(
    output_dir: Path, max_steps: int, *, full_model: bool = False, resume: bool = False
) -> tuple[torch.nn.Module, dict[int, float]]:
    """The trained model and the loss logged at each step."""
    model = _model()
    trainer = transformers.Trainer(
        model=model,
        args=_args(output_dir, max_steps),
        train_dataset=_dataset(),
        callbacks=[loragen.LoraTrainerCallback(full_model=full_model)],
    )
    trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-2") if resume else None)
    losses = {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row}
    return model, losses


@pytest.fixture(scope="module")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, torch.Tensor], dict[int, float]]:
    out = tmp_path_factory.mktemp("uninterrupted")
    model, losses = _train(out, 4)
    return out, _lora_state(model), losses


def test_every_checkpoint_holds_the_peft_adapter_and_no_base_weight(uninterrupted) -> None:
    out, final, _ = uninterrupted
    trainable = {name for name, p in _model().named_parameters() if p.requires_grad}
    for step in (2, 4):
        folder = out / f"checkpoint-{step}"
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        assert (folder / "trainer_state.json").is_file() and not (folder / "config.json").exists()
        assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
        # the weights file Trainer resumes from holds what trains and nothing else
        assert set(load_file(str(folder / "model.safetensors"))) == trainable
    saved = load_file(str(out / "checkpoint-4" / "adapter_model.safetensors"))
    assert saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].equal(
        final["model.layers.0.self_attn.q_proj.lora_A"]
    )
    peft = pytest.importorskip("peft")
    base = transformers.LlamaForCausalLM(_model().config)
    loaded = peft.PeftModel.from_pretrained(base, str(out / "checkpoint-4"))
    assert (
        loaded.base_model.model.model.layers[1]
        .self_attn.v_proj.lora_B["default"]
        .weight.equal(final["model.layers.1.self_attn.v_proj.lora_B"])
    )


@pytest.mark.parametrize("full_model", [False, True])
def test_resume_from_checkpoint_continues_like_an_uninterrupted_run(
    uninterrupted, tmp_path: Path, full_model: bool
) -> None:
    _, expected, expected_losses = uninterrupted
    _train(tmp_path, 2, full_model=full_model)
    folder = tmp_path / "checkpoint-2"
    weights = load_file(str(folder / "model.safetensors"))
    assert all("lora_" in key for key in weights) is not full_model  # by default: what trains, nothing else
    assert (folder / "config.json").is_file() is full_model
    assert (folder / "optimizer.pt").is_file() and (folder / "adapter_model.safetensors").is_file()
    model, losses = _train(tmp_path, 4, full_model=full_model, resume=True)
    resumed = _lora_state(model)
    assert resumed.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    # steps 1-2 come from the checkpoint's trainer state, 3-4 are trained after resuming
    assert set(losses) == set(expected_losses) == {1, 2, 3, 4}
    for step, loss in losses.items():
        assert loss == pytest.approx(expected_losses[step], rel=1e-5), step


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_exact_resume_does_not_warn_about_missing_base_weights(tmp_path: Path) -> None:
    _train(tmp_path, 2)
    records = _Records()
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addHandler(records)
    try:
        _train(tmp_path, 4, resume=True)
    finally:
        trainer_logger.removeHandler(records)
    assert not [m for m in records.messages if "missing keys" in m]


def test_a_resume_that_lacks_a_trainable_tensor_still_warns(tmp_path: Path) -> None:
    _train(tmp_path, 2)
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    tensors = load_file(str(weights))
    dropped = "model.layers.0.self_attn.q_proj.lora_A"
    del tensors[dropped]
    from safetensors.torch import save_file

    save_file(tensors, str(weights))
    records = _Records()
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addHandler(records)
    try:
        _train(tmp_path, 4, resume=True)
    finally:
        trainer_logger.removeHandler(records)
    assert any("missing keys" in m and dropped in m for m in records.messages)


def test_load_best_model_at_end_restores_the_best_checkpoints_adapter(tmp_path: Path) -> None:
    # transformers' own case (test_peft_integration: "LoRA works with load_best_model_at_end"), on a loragen
    # model whose checkpoints hold only what trains
    model = _model()
    args = _args(tmp_path, 4)
    args.eval_strategy = "steps"
    args.eval_steps = 2
    args.load_best_model_at_end = True
    args.metric_for_best_model = "loss"
    args.greater_is_better = True  # the worse checkpoint (step 2) is "best": loading it changes the model
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_dataset(),
        eval_dataset=_dataset(4),
        callbacks=[loragen.LoraTrainerCallback()],
    )
    records = _Records()
    logging.getLogger("transformers.trainer").addHandler(records)
    try:
        trainer.train()
    finally:
        logging.getLogger("transformers.trainer").removeHandler(records)
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == "checkpoint-2"
    saved = load_file(str(best / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(state[key], value) for key, value in saved.items())
    assert not [m for m in records.messages if "missing keys" in m]


def test_trainer_save_model_writes_the_adapter_as_for_a_peft_model(tmp_path: Path) -> None:
    model = _model()
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, 1), train_dataset=_dataset(4))
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "final" / "model.safetensors").exists()


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(c): c - 95 for c in range(97, 123)}, " ": 28}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>"
    )


def test_trl_sft_trainer_checkpoints_hold_the_adapter(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = _model()
    texts = ["the quick brown fox", "jumps over the lazy dog", "lora adapters train fast", "small and exact"]
    dataset = datasets.Dataset.from_dict({"text": texts * 2})
    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        save_steps=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_length=32,
        logging_steps=100,
    )
    before = _lora_state(model)
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=_tokenizer(),
        callbacks=[loragen.LoraTrainerCallback()],
    )
    trainer.train()
    folder = tmp_path / "checkpoint-2"
    assert (folder / "adapter_model.safetensors").is_file()
    after = _lora_state(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    fresh = transformers.LlamaForCausalLM(model.config)
    loragen.load_adapter(fresh, folder)
    for key, value in after.items():
        torch.testing.assert_close(fresh.state_dict()[key], value)
