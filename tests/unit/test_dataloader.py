"""The data loader of ``initialize(training_data=...)`` (issue 18, bug 6).

Workers start with the platform's default method (not always ``spawn``), so a DeepSpeed-style
script without an ``if __name__ == "__main__":`` guard runs with ``--dataloader_num_workers 2``
on Linux; worker seeds are distinct across workers, ranks and epochs and reproducible.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from shardwise.runtime.dataloader import ShardwiseDataLoader

DEFAULT_IS_FORK = multiprocessing.get_context().get_start_method() == "fork"

# A DeepSpeed-style training script: everything at module level, no __main__ guard.
UNGUARDED_SCRIPT = textwrap.dedent('''
    import argparse, json
    import torch
    import shardwise

    parser = argparse.ArgumentParser()
    shardwise.add_config_arguments(parser)
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(torch.arange(24.0).view(12, 2))
    model = torch.nn.Linear(2, 1)
    config = {"train_micro_batch_size_per_gpu": 3,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = shardwise.initialize(args=args, model=model,
                                                model_parameters=model.parameters(),
                                                training_data=data, config=config)
    batches = []
    for (x,) in loader:
        loss = engine(x).sum()
        engine.backward(loss)
        engine.step()
        batches.append(x[:, 0].tolist())
    print("BATCHES " + json.dumps({"workers": loader.loader.num_workers, "batches": batches}))
''')


@pytest.mark.skipif(not DEFAULT_IS_FORK, reason="this platform's default start method re-runs "
                    "the main script (spawn/forkserver): an unguarded script cannot use "
                    "DataLoader workers there, as with plain PyTorch")
def test_unguarded_script_with_two_dataloader_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), "--dataloader_num_workers", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BATCHES ")]
    result = json.loads(line[-1][len("BATCHES "):])
    assert result["workers"] == 2
    firsts = sorted(v for batch in result["batches"] for v in batch)
    assert firsts == [float(2 * i) for i in range(12)]  # every sample once, through the workers


class SeedProbe(Dataset):
    """Each sample reports the seed of the worker that loaded it and a draw from torch's RNG."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        info = get_worker_info()
        return torch.tensor([i, info.id, info.seed % (2**31), torch.randint(0, 2**30, ()).item()],
                            dtype=torch.int64)


def _epoch(loader: ShardwiseDataLoader):
    seeds, draws = {}, {}
    for batch in loader:
        for i, worker, seed, draw in batch.tolist():
            seeds[worker] = seed
            draws[i] = draw
    return seeds, draws


def _loader(rank: int, seed: int = 7) -> ShardwiseDataLoader:
    return ShardwiseDataLoader(SeedProbe(), batch_size=2, rank=rank, world_size=2,
                               num_workers=2, seed=seed)


def test_worker_seeds_distinct_and_reproducible():
    rank0, rank1 = _loader(0), _loader(1)
    seeds_e0, draws_e0 = _epoch(rank0)
    seeds_e1, _ = _epoch(rank0)
    other_rank, _ = _epoch(rank1)
    assert len(set(seeds_e0.values())) == 2  # distinct per worker
    assert not set(seeds_e0.values()) & set(other_rank.values())  # ... per rank
    assert not set(seeds_e0.values()) & set(seeds_e1.values())  # ... per epoch
    again = _loader(0)
    assert _epoch(again) == (seeds_e0, draws_e0)  # reproducible
    resumed = _loader(0)
    resumed.load_state_dict({"epoch": 1, "position": 0})
    assert _epoch(resumed)[0] == seeds_e1  # a resumed run gets the original run's seeds
    assert _epoch(_loader(0, seed=8))[0] != seeds_e0


def test_loader_uses_the_platform_default_start_method():
    loader = _loader(0)
    assert loader.loader.multiprocessing_context is None or \
        loader.loader.multiprocessing_context.get_start_method() == \
        multiprocessing.get_start_method()
