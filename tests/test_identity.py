"""One canonical UUID form from every form users meet."""

import pytest

from gpu_serde import canonical_uuid
from gpu_serde.identity import uuid_bytes

CANON = "GPU-80af18ad-db29-e7bb-0779-dc648400ac90"


@pytest.mark.parametrize(
    "form",
    [
        "80af18ad-db29-e7bb-0779-dc648400ac90",  # cuda.core Device.uuid
        "GPU-80af18ad-db29-e7bb-0779-dc648400ac90",  # NVML / nvidia-smi
        "GPU-80AF18AD-DB29-E7BB-0779-DC648400AC90",
        "gpu-80af18ad-db29-e7bb-0779-dc648400ac90",
        "80af18addb29e7bb0779dc648400ac90",
        "  GPU-80af18ad-db29-e7bb-0779-dc648400ac90\n",
        bytes.fromhex("80af18addb29e7bb0779dc648400ac90"),
    ],
)
def test_every_form_gives_the_canonical_uuid(form):
    assert canonical_uuid(form) == CANON


def test_mig_uuids_keep_their_prefix():
    assert canonical_uuid("MIG-80AF18AD-db29-e7bb-0779-dc648400ac90") == "MIG" + CANON[3:]
    assert canonical_uuid(uuid_bytes(CANON), mig=True) == "MIG" + CANON[3:]


def test_uuid_bytes_round_trips():
    assert canonical_uuid(uuid_bytes(CANON)) == CANON


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "GPU-",
        "GPU-80af18ad",  # a prefix selects a GPU in CUDA_VISIBLE_DEVICES but is no identity
        "80af18ad-db29-e7bb-0779-dc648400ac9",
        "80af18ad-db29-e7bb-0779-dc648400ac900",
        "80af18ad-db29-e7bb-0779-dc648400ac9g",
        "80af18addb29-e7bb-0779-dc648400ac90",
        "XPU-80af18ad-db29-e7bb-0779-dc648400ac90",
        "0",
        b"\x00" * 15,
        12,
        None,
    ],
)
def test_anything_else_is_a_clear_value_error(bad):
    with pytest.raises(ValueError, match="UUID"):
        canonical_uuid(bad)
