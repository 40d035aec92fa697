"""A compact DeepSpeed-Chat step 3 (PPO) loop on shardwise's Hybrid Engine.

    python examples/rlhf_ppo.py                              # CPU, tiny Llama, well under 2 min
    python examples/rlhf_ppo.py --family opt --iters 4
    shardwise examples/rlhf_ppo.py --model-size 1.1b --bf16 --batch 16 --prompt-len 256 \
        --gen-len 256 --iters 5                              # one GPU (or several: ZeRO-3 DP)

Four models, as in DeepSpeed-Chat: the actor (trained, ``hybrid_engine`` on: it generates
the experience and trains on it), a frozen reference copy of the actor
(``shardwise.init_inference``), a critic (trained value model) and a frozen reward model
(value head on a smaller decoder). Models are random-init from configs (no downloads); the
prompts are a built-in list encoded byte by byte, so the loop runs anywhere. One iteration:

1. experience: the actor samples ``--gen-len`` tokens per prompt; the actor and the reference
   score them (log-probs), the critic gives values, the reward model a score per sequence;
2. rewards: ``-kl_coef * (logp - ref_logp)`` per token, plus the clipped score on the last;
   advantages and returns by GAE;
3. training: the clipped PPO policy loss for the actor, the clipped value loss for the critic.

The progress bar shows each iteration's generation and training time; the actor's
hybrid-engine latency line (DeepSpeed's format) is printed at each ``eval()``.
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import shardwise

PROMPTS = [
    "Human: How do I bake bread? Assistant:", "Human: Explain gravity to a child. Assistant:",
    "Human: Write a haiku about rain. Assistant:", "Human: What is a prime number? Assistant:",
    "Human: Give me a tip for learning Python. Assistant:", "Human: Why is the sky blue? Assistant:",
    "Human: Suggest a name for a cat. Assistant:", "Human: How far is the moon? Assistant:",
    "Human: Summarize the water cycle. Assistant:", "Human: What should I cook tonight? Assistant:",
    "Human: How do plants make food? Assistant:", "Human: Tell me a short joke. Assistant:",
    "Human: What is ZeRO in deep learning? Assistant:", "Human: How do I stay focused? Assistant:",
    "Human: Describe a sunset in one line. Assistant:", "Human: What is RLHF? Assistant:",
]

SIZES: Dict[str, Dict[str, int]] = {  # Llama shapes; OPT uses hidden/layers/heads/ffn
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=256),
    "small": dict(hidden=256, layers=4, heads=8, kv=4, ffn=688, vocab=512),
    "1.1b": dict(hidden=2048, layers=22, heads=32, kv=4, ffn=5632, vocab=32000),
    "7b": dict(hidden=4096, layers=32, heads=32, kv=32, ffn=11008, vocab=32000),
}
PAD, EOS = 0, 2


def lm_config(family: str, s: Dict[str, int], layers: int, max_len: int):
    from transformers import LlamaConfig, OPTConfig
    if family == "llama":
        return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                           num_hidden_layers=layers, num_attention_heads=s["heads"],
                           num_key_value_heads=s["kv"], max_position_embeddings=max_len,
                           pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)
    return OPTConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], ffn_dim=s["ffn"],
                     num_hidden_layers=layers, num_attention_heads=s["heads"],
                     max_position_embeddings=max_len, word_embed_proj_dim=s["hidden"],
                     pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1, dropout=0.0)


class ValueModel(nn.Module):
    """A decoder with a scalar head: the critic (values per token) and the reward model."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import AutoModel
        self.base = AutoModel.from_config(config)
        self.v_head = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.v_head(h).squeeze(-1)


def encode(prompts: List[str], length: int, vocab: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Byte-level ids (3..vocab-1), left-padded / truncated to ``length``."""
    ids = torch.full((len(prompts), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, text in enumerate(prompts):
        toks = [3 + b % (vocab - 3) for b in text.encode()][-length:]
        ids[i, length - len(toks):] = torch.tensor(toks)
        mask[i, length - len(toks):] = 1
    return ids, mask


def logprobs_of(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """log p(seq[t+1] | seq[:t+1]) for every position t."""
    return torch.gather(F.log_softmax(logits[:, :-1].float(), -1), 2, seq[:, 1:, None]).squeeze(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95):
    adv, last = torch.zeros_like(rewards), 0.0
    for t in reversed(range(rewards.shape[1])):
        nxt = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    return adv, adv + values


def engines(args):
    s = SIZES[args.model_size]
    max_len = args.prompt_len + args.gen_len
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    torch.manual_seed(args.seed)
    actor_model = shardwise_model(args, s, s["layers"], max_len)
    ref_model = copy.deepcopy(actor_model)
    if args.lora_dim > 0:  # DeepSpeed-Chat's --actor_lora_dim: train LoRA adapters only
        actor_model = with_lora(actor_model, args.lora_dim)
    small = max(2, s["layers"] // 2)
    critic_model = ValueModel(lm_config(args.family, s, small, max_len))
    reward_model = ValueModel(lm_config(args.family, s, small, max_len)).to(dtype).eval()
    zero = {"stage": args.zero_stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    base = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": zero,
            "bf16": {"enabled": args.bf16}, "steps_per_print": 10 ** 6, "gradient_clipping": 1.0}
    actor, *_ = shardwise.initialize(model=actor_model, config=dict(
        base, optimizer={"type": "AdamW", "params": {"lr": args.actor_lr}},
        hybrid_engine={"enabled": True, "max_out_tokens": max_len,
                       "inference_tp_size": args.inference_tp_size,
                       "release_inference_cache": args.release_inference_cache}))
    critic, *_ = shardwise.initialize(model=critic_model, config=dict(
        base, optimizer={"type": "AdamW", "params": {"lr": args.critic_lr}}))
    ref = shardwise.init_inference(ref_model, dtype=dtype, replace_with_kernel_inject=True,
                                   max_out_tokens=max_len)
    reward_model.to(actor.device)
    return actor, ref, critic, reward_model


def with_lora(model: nn.Module, dim: int) -> nn.Module:
    try:
        import peft
    except ImportError:
        raise SystemExit("--lora-dim needs PEFT: pip install peft") from None
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj",
               "out_proj", "fc1", "fc2"]
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    lora = peft.LoraConfig(r=dim, lora_alpha=2 * dim, target_modules=[t for t in targets if t in present])
    return peft.get_peft_model(model, lora)


def shardwise_model(args, s, layers, max_len):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(lm_config(args.family, s, layers, max_len))


@torch.no_grad()
def experience(args, actor, ref, critic, reward, ids, mask):
    actor.eval()
    t0 = time.perf_counter()
    seq = actor.generate(ids, attention_mask=mask, max_new_tokens=args.gen_len, do_sample=True,
                         top_k=0, top_p=1.0, pad_token_id=PAD, eos_token_id=EOS)
    gen_s = time.perf_counter() - t0
    seq_mask = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
    seq_mask[:, ids.shape[1]:] &= (seq[:, ids.shape[1]:] != PAD).long()
    logp = logprobs_of(actor(seq, attention_mask=seq_mask).logits, seq)
    ref_logp = logprobs_of(ref(seq, attention_mask=seq_mask).logits, seq)
    values = critic(seq, seq_mask)[:, :-1].float()
    score = reward(seq, seq_mask)[:, -1].float()
    return dict(seq=seq, mask=seq_mask, logp=logp, ref_logp=ref_logp, values=values,
                score=score, gen_s=gen_s)


def ppo_train(args, actor, critic, exp, start: int):
    actor.train()
    critic.train()
    act_mask = exp["mask"][:, 1:].float()
    act_mask[:, :start - 1] = 0  # only the generated tokens are actions
    rewards = -args.kl_coef * (exp["logp"] - exp["ref_logp"])
    last = (act_mask.cumsum(1) == act_mask.sum(1, keepdim=True)) & (act_mask > 0)
    rewards = rewards + last * exp["score"].clamp(-5, 5)[:, None]
    adv, returns = gae(rewards * act_mask, exp["values"] * act_mask)
    n = act_mask.sum().clamp(min=1)
    logp = logprobs_of(actor(exp["seq"], attention_mask=exp["mask"]).logits, exp["seq"])
    ratio = torch.exp((logp - exp["logp"]) * act_mask)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip, 1 + args.clip))
    actor_loss = (pg * act_mask).sum() / n
    actor.backward(actor_loss)
    actor.step()
    values = critic(exp["seq"], exp["mask"])[:, :-1].float()
    clipped = exp["values"] + (values - exp["values"]).clamp(-args.clip, args.clip)
    vf = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    critic_loss = 0.5 * (vf * act_mask).sum() / n
    critic.backward(critic_loss)
    critic.step()
    return float(actor_loss.detach()), float(critic_loss.detach()), float(exp["score"].mean())


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--family", choices=["llama", "opt"], default="llama")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="prompts per rank per iteration")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--offload", action="store_true", help="offload the optimizers to CPU")
    p.add_argument("--release-inference-cache", action="store_true")
    p.add_argument("--inference-tp-size", type=int, default=1,
                   help="hybrid_engine.inference_tp_size: tensor-parallel generation groups")
    p.add_argument("--lora-dim", type=int, default=0, help="train LoRA adapters of this rank (PEFT)")
    p.add_argument("--actor-lr", type=float, default=1e-4)
    p.add_argument("--critic-lr", type=float, default=5e-5)
    p.add_argument("--kl-coef", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args(argv)
    actor, ref, critic, reward = engines(args)
    vocab = SIZES[args.model_size]["vocab"]
    rank = actor.global_rank
    bar = tqdm(range(args.iters), desc="PPO", disable=rank != 0)
    totals = {"gen_s": 0.0, "train_s": 0.0}
    for it in bar:
        picks = [PROMPTS[(it * args.batch + i + rank * 7) % len(PROMPTS)] for i in range(args.batch)]
        ids, mask = (t.to(actor.device) for t in encode(picks, args.prompt_len, vocab))
        exp = experience(args, actor, ref, critic, reward, ids, mask)
        t0 = time.perf_counter()
        a_loss, c_loss, score = ppo_train(args, actor, critic, exp, args.prompt_len)
        train_s = time.perf_counter() - t0
        totals["gen_s"] += exp["gen_s"]
        totals["train_s"] += train_s
        stats = dict(gen=f"{exp['gen_s']:.2f}s", train=f"{train_s:.2f}s", actor=f"{a_loss:.3f}",
                     critic=f"{c_loss:.3f}", reward=f"{score:.3f}")
        if actor.device.type == "cuda":  # peak memory of the whole PPO iteration
            totals["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            stats["peak"] = f"{totals['peak_gib']:.1f}GiB"
            torch.cuda.reset_peak_memory_stats()
        bar.set_postfix(**stats)
    actor.eval()  # prints the last iteration's hybrid-engine latency line
    totals.update(actor_loss=a_loss, critic_loss=c_loss, iters=float(args.iters))
    return totals


if __name__ == "__main__":
    main()
