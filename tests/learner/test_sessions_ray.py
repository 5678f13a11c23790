"""The session verbs on 2 learner ranks as Ray actors (as `posttrain serve` starts them,
recipes/roles.py), with the object-store transport: a session's publish streams rank
0's handle, whose adapter is the session's (named for it, at its true rank) and whose
delivery proof counts as an adapter push."""

from __future__ import annotations

import torch

from posttrain.learner.settings import SessionSettings
from posttrain.learner.worker import LearnerSettings, LearnerWorker
from posttrain.weightsync import Delivery, TransportSettings, make_transport
from tests.learner.test_sessions import ADAM, make_batch, shard


def test_publish_session_through_ray_and_the_object_store(ray_local, tiny_model, tmp_path):
    import ray

    settings = LearnerSettings(
        model_path=str(tiny_model),
        compute_dtype="bfloat16",
        transport=TransportSettings(type="object_store", checksum=True),
        sessions=SessionSettings(max_rank=4, max_sessions=2, target_modules=("q_proj", "v_proj")),
    )
    actor = ray.remote(num_cpus=0)(LearnerWorker)
    ranks = [actor.remote(r, 2, settings, 1) for r in range(2)]
    try:
        master = ray.get(ranks[0].rendezvous.remote())["address"]
        ray.get([w.setup.remote(master) for w in ranks])
        ray.get([w.open_session.remote("t1", 3, 0, True, True) for w in ranks])
        batch = make_batch(60)
        fb = [w.session_forward_backward for w in ranks]
        ray.get(
            [
                f.remote("t1", shard(batch, r, 2), "cross_entropy", {}, True)
                for r, f in enumerate(fb)
            ]
        )
        steps = ray.get([w.session_optim_step.remote("t1", ADAM) for w in ranks])
        assert steps[0] == steps[1] and steps[0]["step"] == 1
        gens = [w.publish_session.options(num_returns="streaming").remote("t1", 5) for w in ranks]
        handle = ray.get(next(gens[0]))
        assert handle.version == 5 and handle.meta["adapter_name"] == "t1"
        assert handle.meta["adapter_config"]["r"] == 3
        pushed = dict(make_transport("object_store").receive(handle))
        items = [ray.get(ref) for g in gens for ref in g]
        proof = [x for x in items if isinstance(x, Delivery)]
        assert len(proof) == 1 and proof[0].adapter and set(proof[0].fingerprints) == set(pushed)
        folder = str(tmp_path / "t1")
        ray.get([w.save_session.remote("t1", folder, False) for w in ranks])
    finally:
        ray.get([w.close.remote() for w in ranks])
    from safetensors.torch import load_file

    saved = load_file(f"{folder}/adapter_model.safetensors")
    assert set(saved) == set(pushed) and len(saved) == 2 * 2 * 2  # 2 layers, q/v, A/B
    for k, v in saved.items():
        assert pushed[k].dtype == torch.bfloat16 and torch.equal(pushed[k], v.bfloat16())
        assert (v.shape[0] if "lora_A" in k else v.shape[1]) == 3
