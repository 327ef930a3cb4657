"""cluster.yaml's `network:` section: the declared fabric, its validation, and the NCCL environment it renders."""

from __future__ import annotations

import textwrap

import pytest

from alpa_job.cluster.fabric import apply_socket_defaults
from alpa_job.cluster.spec import load_spec
from alpa_job.errors import EXIT_USER_ERROR, KitError

# NCCL's socket transport settings, rendered on every fabric (NCCL's documented recommendation for 100G).
SOCKETS = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_P2P_NET_CHUNKSIZE": "524288"}


def spec_with(tmp_path, text):
    path = tmp_path / "my-cluster.yaml"
    path.write_text(textwrap.dedent(text))
    return load_spec(str(path))


def refused(tmp_path, text):
    with pytest.raises(KitError) as err:
        spec_with(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == EXIT_USER_ERROR
    return message


def test_the_default_is_sockets_declared_as_ethernet():
    spec = load_spec()
    assert (spec.network.fabric, spec.network.gbps, spec.network.ib_hca, spec.network.ib_gid_index) == ("ethernet", 0, "", None)
    assert not spec.network.rdma
    assert spec.nccl_env() == {"NCCL_IB_DISABLE": "1", **SOCKETS}


def test_infiniband_enables_nccls_ib_transport_on_the_declared_hcas(tmp_path):
    spec = spec_with(
        tmp_path,
        """
        network: {fabric: ib, gbps: 400, ib_hca: "mlx5_0:1,mlx5_1:1"}
    """,
    )
    assert spec.network.rdma and spec.network.gbps == 400
    assert spec.nccl_env() == {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1", **SOCKETS}
    # No HCA named: NCCL takes every one it finds, so only the switch is set (and the socket fallback's settings).
    assert spec_with(tmp_path, "network: {fabric: ib}\n").nccl_env() == {"NCCL_IB_DISABLE": "0", **SOCKETS}


def test_roce_also_sets_the_gid_index(tmp_path):
    spec = spec_with(
        tmp_path,
        """
        network:
          fabric: roce
          gbps: 100
          ib_hca: "=mlx5_2"
          ib_gid_index: 3
    """,
    )
    assert spec.nccl_env() == {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "=mlx5_2", "NCCL_IB_GID_INDEX": "3", **SOCKETS}
    assert spec.as_dict()["network"] == {"fabric": "roce", "gbps": 100, "ib_hca": "=mlx5_2", "ib_gid_index": 3}


def test_every_fabric_renders_the_same_socket_settings(tmp_path):
    for fabric in ("ethernet", "ib", "roce"):
        assert spec_with(tmp_path, "network: {fabric: %s}\n" % fabric).network.socket_env() == SOCKETS


def test_socket_defaults_fill_in_what_the_environment_lacks():
    environ = {"PATH": "/usr/bin"}
    assert apply_socket_defaults(environ) == SOCKETS
    assert environ == {"PATH": "/usr/bin", **SOCKETS}
    assert apply_socket_defaults(environ) == {}  # a second call sets nothing


def test_socket_defaults_leave_a_users_own_value_alone():
    environ = {"NCCL_SOCKET_NTHREADS": "8"}
    assert apply_socket_defaults(environ) == {"NCCL_NSOCKS_PERTHREAD": "4", "NCCL_P2P_NET_CHUNKSIZE": "524288"}
    assert environ == {"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_P2P_NET_CHUNKSIZE": "524288"}


def test_a_user_file_changes_only_the_network_keys_it_sets(tmp_path):
    spec = spec_with(tmp_path, "network: {gbps: 25.5}\n")
    assert spec.network.gbps == 25.5 and spec.network.fabric == "ethernet"
    assert spec.ports == load_spec().ports


@pytest.mark.parametrize(
    "text, expected",
    [
        ("network: {fabric: infiniband}\n", "network.fabric is 'infiniband'; use one of: ib, roce, ethernet"),
        ("network: {fabric: null}\n", "use one of: ib, roce, ethernet"),
        ("network: {gbps: -1}\n", "network.gbps is -1; declare each node's link in Gbit/s"),
        ("network: {gbps: fast}\n", "network.gbps is 'fast'"),
        ("network: {gbps: true}\n", "network.gbps is True"),
        ("network: {ib_hca: mlx5_0}\n", "network.ib_hca is set but fabric is ethernet"),
        ("network: {fabric: ib, ib_hca: 5}\n", "network.ib_hca must be a quoted string"),
        ("network: {fabric: ib, ib_hca: 'mlx5 0'}\n", "is not an NCCL_IB_HCA list"),
        ("network: {fabric: ib, ib_gid_index: 3}\n", "ib_gid_index applies to RoCE only and fabric is ib"),
        ("network: {fabric: roce, ib_gid_index: -2}\n", "network.ib_gid_index is -2"),
        ("network: {fabic: ib}\n", "unknown key network.fabic"),
        ("network: ib\n", "network must be a mapping"),
    ],
)
def test_invalid_network_values_are_refused_with_the_fix(tmp_path, text, expected):
    assert expected in refused(tmp_path, text)
