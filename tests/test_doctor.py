"""``gpu-serde doctor`` flags workers without gpu_serde and GPUs that two workers compute on."""

from distributed import Nanny, Scheduler, SpecCluster

from gpu_serde.tools import doctor


def test_doctor_flags_a_missing_install_and_a_shared_device_0(simulated_gpus):
    u = [g.uuid for g in simulated_gpus]
    workers = {
        name: {
            "cls": Nanny,
            "options": {"nthreads": 1, "host": "127.0.0.1", "env": {"CUDA_VISIBLE_DEVICES": cvd}},
        }
        for name, cvd in {"x": u[0], "y": f"{u[0]},{u[1]}", "z": u[2]}.items()
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
    }
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster:
        survey = doctor.survey_dask(cluster.scheduler_address)
    reports = {r.name.split(" ")[0]: r for r in survey.workers}
    text = doctor.render(survey)
    assert set(reports) == {"x", "y", "z"}
    assert [g for _, g in reports["y"].gpus] == [u[0], u[1]]
    assert any(f"{u[0]} is also device 0 of worker y" in p for p in reports["x"].problems)
    assert not any("device 0" in p for p in reports["z"].problems)
    # nobody registered the plugin or preloaded gpu_serde: every worker and the scheduler is flagged
    assert all(not r.installed for r in reports.values())
    assert "gpu_serde NOT set up" in text
    assert "3 worker(s), 4 process(es) with problems: PROBLEMS" in text
    assert not survey.ok


def test_the_ray_report_lists_the_head_first_then_nodes_by_address_whatever_ray_returns():
    def node(nid: str, address: str, head: bool = False, alive: bool = True) -> dict:
        resources = {"CPU": 1.0, **({"node:__internal_head__": 1.0} if head else {})}
        return {
            "NodeID": nid,
            "NodeManagerAddress": address,
            "Alive": alive,
            "Resources": resources,
        }

    listed = [
        node("c3", "127.0.0.10"),
        node("b2", "127.0.0.2"),
        node("dead", "127.0.0.1", alive=False),
        node("f9", "127.0.0.9", head=True),
        node("a1", "127.0.0.2"),
        node("e5", "localhost"),
        node("d4", "127.0.0.3"),
    ]

    class Cluster:  # what ray.nodes() answers, in the order Ray happens to give
        @staticmethod
        def nodes() -> list[dict]:
            return listed

    order = [n["NodeID"] for n in doctor._alive_nodes(Cluster, expect=6, timeout=0)]
    assert order == ["f9", "a1", "b2", "d4", "c3", "e5"]
    listed.reverse()
    assert [n["NodeID"] for n in doctor._alive_nodes(Cluster, expect=6, timeout=0)] == order
