"""Worker-side scenarios for tests/distributed/test_hf_integration.py.

This module turns the deepspeed alias on at import, before transformers or accelerate are
imported, exactly as a user's training script does: spawned workers import it fresh, so
the test process's own imports cannot have decided "no DeepSpeed" first.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import shardwise.integrations

shardwise.integrations.use_as_deepspeed()

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

SEQ, VOCAB, SAMPLES = 16, 128, 32


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic random token sequences; labels = inputs (causal LM)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_model(kind: str = "gpt2") -> torch.nn.Module:
    """A tiny GPT-2 or Llama (GQA) built from a transformers config, seeded."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB,
                                      n_positions=SEQ, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def ds_config(stage: int, with_optimizer: bool = False, **zero: Any) -> Dict[str, Any]:
    """A Trainer-style ds_config: everything the Trainer knows is "auto"."""
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", **zero},
    }
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto"})
    if with_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}}
    return cfg


def training_args(out: str, deepspeed: Optional[Dict[str, Any]], **overrides: Any):
    kw = dict(output_dir=out, max_steps=3, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.01,
              warmup_steps=1, max_grad_norm=1.0, report_to="none", use_cpu=True,
              dataloader_num_workers=0, logging_steps=1, save_strategy="no", seed=0,
              disable_tqdm=True, deepspeed=copy.deepcopy(deepspeed))
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def full_params(trainer: Any) -> Dict[str, torch.Tensor]:
    """Every parameter whole (gathered under stage 3), fp32, on the CPU."""
    model = trainer.model
    params = [p for _, p in model.named_parameters()]
    with shardwise.zero.GatheredParameters(params):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def losses(trainer: Any) -> List[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def grad_norms(trainer: Any) -> List[float]:
    return [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]


def run_trainer(out: str, deepspeed: Optional[Dict[str, Any]], kind: str = "gpt2",
                resume: Optional[str] = None, **overrides: Any) -> Dict[str, Any]:
    args = training_args(out, deepspeed, **overrides)
    trainer = transformers.Trainer(model=tiny_model(kind), args=args, train_dataset=TokenDataset())
    trainer.train(resume_from_checkpoint=resume)
    return {"losses": losses(trainer), "grad_norms": grad_norms(trainer),
            "params": full_params(trainer), "engine": type(trainer.model_wrapped).__name__,
            "trainer": trainer}


# --------------------------------------------------------------------------- scenarios
KEEP = ("losses", "grad_norms", "params", "engine")


def _kept(run: Dict[str, Any]) -> Dict[str, Any]:
    return {k: run[k] for k in KEEP}


def _guarded(results: Dict[str, Any], name: str, fn: Any, *args: Any) -> None:
    """Run one scenario; a failure is recorded (with its traceback) so the others still run."""
    import traceback
    try:
        results[name] = fn(*args)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        results[name] = {"error": traceback.format_exc()}


def trainer_stage(out: str, stage: int) -> Dict[str, Any]:
    """Stage ``stage`` with the Trainer's own AdamW + linear schedule, checkpoint at step 2;
    then a fresh Trainer resumed from that checkpoint."""
    full = run_trainer(os.path.join(out, f"s{stage}"), ds_config(stage), save_strategy="steps",
                       save_steps=2)
    ckpt = os.path.join(out, f"s{stage}", "checkpoint-2")
    resumed = run_trainer(os.path.join(out, f"s{stage}"), ds_config(stage), resume=ckpt)
    return {"full": _kept(full), "resumed": _kept(resumed),
            "ckpt_files": sorted(str(p.relative_to(ckpt)) for p in Path(ckpt).rglob("*")
                                 if p.is_file())[:50]}


def auto_values(out: str) -> Dict[str, Any]:
    """Stage 3 with the optimizer and scheduler in the ds_config, every value "auto"."""
    run = run_trainer(os.path.join(out, "auto"), ds_config(3, with_optimizer=True),
                      kind="llama")
    engine = run["trainer"].model_wrapped
    cfg = engine.config
    return {"optimizer": dict(cfg.optimizer.params), "optimizer_type": type(engine.optimizer.inner).__name__,
            "scheduler": dict(cfg.scheduler.params), "scheduler_type": type(engine.lr_scheduler).__name__,
            "batch": (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                      cfg.gradient_accumulation_steps),
            "clip": cfg.gradient_clipping,
            "zero": {k: getattr(cfg.zero_optimization, k) for k in (
                "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")},
            "lrs": [h["learning_rate"] for h in run["trainer"].state.log_history if "learning_rate" in h and "loss" in h],
            "losses": run["losses"]}


def zero3_from_pretrained(out: str) -> Dict[str, Any]:
    """``from_pretrained`` while a stage-3 TrainingArguments is alive builds the model under
    ``zero.Init`` (partitioned at construction) and loads the weights into the partitions;
    the Trainer then trains it and ``save_model`` writes the gathered 16-bit weights."""
    from safetensors.torch import load_file
    from shardwise.zero.stage3 import partition as P
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    src = os.path.join(out, "llama-src")
    tiny_model("llama").save_pretrained(src)
    saved = load_file(os.path.join(src, "model.safetensors"))
    cfg = ds_config(3, stage3_gather_16bit_weights_on_model_save=True)
    args = training_args(os.path.join(out, "z3"), cfg)
    zero3 = is_deepspeed_zero3_enabled()
    model = transformers.LlamaForCausalLM.from_pretrained(src)
    partitioned = sorted(n for n, p in model.named_parameters() if P.is_partitioned(p))
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    trained = full_params(trainer)
    trainer.save_model(os.path.join(out, "z3-export"))
    exported = load_file(os.path.join(out, "z3-export", "model.safetensors"))
    eval_loss = trainer.evaluate(TokenDataset())["eval_loss"]
    plain = transformers.LlamaForCausalLM(model.config)  # not from_pretrained: no zero.Init
    plain.load_state_dict(trained)
    batch = torch.utils.data.default_collate([TokenDataset()[i] for i in range(SAMPLES)])
    with torch.no_grad():
        ref_eval_loss = plain(**batch).loss.item()
    return {"zero3_enabled": zero3, "partitioned": partitioned, "saved": saved,
            "loaded": loaded, "trained": trained, "exported": exported,
            "losses": losses(trainer), "eval_loss": eval_loss, "ref_eval_loss": ref_eval_loss}


def accelerate_direct(out: str) -> Dict[str, Any]:
    """Accelerator(deepspeed_plugin=...) + prepare / backward / step, gradient accumulation 2,
    against the same loop in plain PyTorch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    data = [TokenDataset()[i] for i in range(8)]
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
          "gradient_clipping": 0.5, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    AcceleratorState._reset_state(True)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
    model = tiny_model("gpt2")
    opt = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    engine, opt, loader = acc.prepare(model, opt, loader)
    ours = []
    for batch in loader:
        with acc.accumulate(engine):
            loss = engine(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        ours.append(loss.item())
    ours_params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    AcceleratorState._reset_state(True)

    ref_model = tiny_model("gpt2")
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = []
    for i, batch in enumerate(torch.utils.data.DataLoader(data, batch_size=2)):
        loss = ref_model(**batch).loss
        (loss / 2).backward()
        ref.append(loss.item())
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
    return {"engine": type(engine).__name__, "steps": engine.global_steps, "losses": ours,
            "ref_losses": ref, "params": ours_params,
            "ref_params": {n: p.detach().clone() for n, p in ref_model.named_parameters()}}


def trainer_ws2(rank: int, world: int, out: str, stage: int) -> Dict[str, Any]:
    """Two ranks: the plain Trainer (DDP over gloo), the Trainer on shardwise with a
    checkpoint at step 2, and a resume from that checkpoint written by two ranks."""
    results: Dict[str, Any] = {}
    _guarded(results, "plain", lambda: _kept(run_trainer(os.path.join(out, "plain"), None)))
    _guarded(results, "full", lambda: _kept(run_trainer(
        os.path.join(out, "ws2"), ds_config(stage), save_strategy="steps", save_steps=2)))
    _guarded(results, "resumed", lambda: _kept(run_trainer(
        os.path.join(out, "ws2"), ds_config(stage),
        resume=os.path.join(out, "ws2", "checkpoint-2"))))
    return results


def scenarios_ws1(rank: int, world: int, out: str) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    _guarded(results, "plain", lambda: _kept(run_trainer(os.path.join(out, "plain"), None)))
    _guarded(results, "stage2", trainer_stage, out, 2)
    _guarded(results, "stage3", trainer_stage, out, 3)
    _guarded(results, "auto", auto_values, out)
    _guarded(results, "zero3_load", zero3_from_pretrained, out)
    _guarded(results, "accelerate", accelerate_direct, out)
    return results


def gpu_scenarios(rank: int, world: int, out: str) -> Dict[str, Any]:
    """On CUDA (tests/gpu/test_hf_trainer_gpu.py): fp32 parity with the plain Trainer at
    stages 2 and 3 (TF32 off), and a bf16 stage-3 run with "auto" precision."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: Dict[str, Any] = {}
    on_gpu = dict(use_cpu=False)
    _guarded(results, "plain", lambda: _kept(run_trainer(os.path.join(out, "plain"), None,
                                                         **on_gpu)))
    for stage in (2, 3):
        _guarded(results, f"stage{stage}", lambda s=stage: _kept(run_trainer(
            os.path.join(out, f"s{s}"), ds_config(s), **on_gpu)))
    bf16 = ds_config(3)
    bf16["bf16"] = {"enabled": "auto"}

    def bf16_run() -> Dict[str, Any]:
        run = run_trainer(os.path.join(out, "bf16"), bf16, bf16=True, **on_gpu)
        engine = run["trainer"].model_wrapped
        return {**_kept(run), "device": str(engine.device),
                "dtype": str(next(engine.module.parameters()).dtype)}
    _guarded(results, "bf16", bf16_run)
    return results
