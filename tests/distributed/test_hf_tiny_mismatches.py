"""The parity helper of the Hugging Face tiny-model tests: rounding passes, bugs do not."""
import torch

from tests.distributed._hf_tiny import mismatches


def _ref():
    g = torch.Generator().manual_seed(0)
    return {"model.layers.1.mlp.gate_proj.weight": torch.randn(32, 64, generator=g) * 0.1}


def test_one_rounding_outlier_passes_and_real_errors_do_not():
    ref = _ref()
    name = next(iter(ref))
    got = {name: ref[name].clone()}
    got[name][3, 5] += 2.5e-5  # the measured outlier: one element, a fraction of an Adam step
    assert mismatches(got, ref) == []
    off_by_a_step = {name: ref[name].clone()}
    off_by_a_step[name][3, 5] += 1e-2  # one element moved by a whole step at lr 1e-2
    assert mismatches(off_by_a_step, ref)
    many = {name: ref[name].clone()}
    many[name].view(-1)[:8] += 2.5e-5  # several elements (a wrong shard, a lost reduction)
    assert mismatches(many, ref)
    swapped = {name: ref[name].flip(0)}
    assert mismatches(swapped, ref)
