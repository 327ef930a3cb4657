"""The cluster spec: package defaults, user overrides, and the validation that guards the port plan."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import yaml

from alpa_job.cluster import spec as spec_mod
from alpa_job.cluster.spec import SPEC_ENV_VAR, PortSpan, load_spec
from alpa_job.errors import EXIT_USER_ERROR, KitError


def write(tmp_path, text, name="my-cluster.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def refused(tmp_path, text):
    with pytest.raises(KitError) as err:
        load_spec(write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == EXIT_USER_ERROR
    return message


def test_defaults_are_the_package_yaml():
    spec = load_spec()
    with open(spec_mod.DEFAULT_SPEC_PATH) as fh:
        raw = yaml.safe_load(fh)
    assert spec.as_dict() == raw
    assert json.loads(json.dumps(spec.as_dict())) == raw  # JSON-ready as it is
    assert spec.source == "package defaults"
    assert spec.cluster_cidr == "10.0.0.0/8"
    assert spec.ports["node_manager"] == 8076
    assert spec.ranges["xla_grpc"] == (20000, 24999)


def test_member_ports_cover_every_port_and_range_with_head_only_flagged():
    spec = load_spec()
    spans = spec.member_tcp_ports()
    assert {s.name for s in spans} == set(spec.ports) | set(spec.ranges)
    assert [s.lo for s in spans] == sorted(s.lo for s in spans)
    assert PortSpan("gcs", 6379, 6379, True) in spans
    assert PortSpan("xla_grpc", 20000, 24999, False) in spans
    assert {s.name for s in spans if s.head_only} == {"gcs", "dashboard", "client"}
    worker = {s.name for s in spec.member_tcp_ports("worker")}
    assert worker == {s.name for s in spans} - {"gcs", "dashboard", "client"}
    assert spec.member_tcp_ports("head") == spans


def test_xla_env_end_is_exclusive_and_sysctl_inclusive():
    spec = load_spec()
    # Alpa draws from [START, END): the inclusive spec range 20000-24999 becomes END=25000.
    assert spec.xla_env() == {"XLA_SERVER_PORT_START": "20000", "XLA_SERVER_PORT_END": "25000"}
    assert spec.sysctl() == {"net.ipv4.ip_local_port_range": "40000 49999"}


def test_spec_is_read_only():
    spec = load_spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.cluster_cidr = "192.168.0.0/16"
    with pytest.raises(TypeError):
        spec.ports["gcs"] = 1


def test_user_file_changes_only_the_keys_it_sets(tmp_path):
    path = write(
        tmp_path,
        """
        cluster_cidr: 192.168.10.0/24
        ports:
          gcs: 6380
        ranges:
          ray_workers: [11000, 11999]
    """,
    )
    spec = load_spec(path)
    defaults = load_spec()
    assert spec.cluster_cidr == "192.168.10.0/24"
    assert spec.ports["gcs"] == 6380
    assert spec.ranges["ray_workers"] == (11000, 11999)
    # Siblings of the changed keys keep their defaults.
    assert {k: v for k, v in spec.ports.items() if k != "gcs"} == {k: v for k, v in defaults.ports.items() if k != "gcs"}
    assert spec.ranges["xla_grpc"] == defaults.ranges["xla_grpc"]
    assert spec.versions == defaults.versions and spec.images == defaults.images
    assert path in spec.source


def test_env_var_names_the_user_file_and_path_argument_wins(tmp_path, monkeypatch):
    env_file = write(tmp_path, "ports: {gcs: 6390}\n", name="env.yaml")
    arg_file = write(tmp_path, "ports: {gcs: 6391}\n", name="arg.yaml")
    monkeypatch.setenv(SPEC_ENV_VAR, env_file)
    assert load_spec().ports["gcs"] == 6390
    assert load_spec(arg_file).ports["gcs"] == 6391


def test_empty_user_file_means_defaults(tmp_path):
    assert load_spec(write(tmp_path, "# nothing set\n")) == load_spec()


def test_port_inside_a_range_is_refused_naming_both(tmp_path):
    message = refused(tmp_path, "ports: {node_manager: 20001}\n")
    assert message.startswith("port plan: node_manager 20001 lies inside range xla_grpc 20000-24999; move one of them")


def test_two_ports_on_one_number_are_refused(tmp_path):
    message = refused(tmp_path, "ports: {object_manager: 8076}\n")
    assert "port plan: node_manager and object_manager both use 8076; move one of them" in message


def test_overlapping_ranges_are_refused(tmp_path):
    message = refused(tmp_path, "ranges: {ray_workers: [10002, 20000]}\n")
    assert "port plan: ranges ray_workers 10002-20000 and xla_grpc 20000-24999 overlap" in message


def test_listening_port_inside_the_ephemeral_range_is_refused(tmp_path):
    message = refused(tmp_path, "ports: {metrics_export: 45000}\n")
    assert "metrics_export 45000 lies inside range ephemeral 40000-49999" in message


def test_unknown_top_level_key_is_refused_with_the_allowed_keys(tmp_path):
    message = refused(tmp_path, "cluster_cdir: 10.0.0.0/8\n")
    assert "unknown key cluster_cdir" in message
    for key in ("cluster_cidr", "ports", "ranges", "jax_coordinator_port", "versions"):
        assert key in message


def test_unknown_nested_key_is_refused_with_that_sections_keys(tmp_path):
    message = refused(tmp_path, "ports: {node_manger: 9000}\n")
    assert "unknown key ports.node_manger" in message
    assert "allowed keys under ports: ssh, gcs, dashboard" in message


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cluster_cidr: 10.0.0.1/8\n", "did you mean 10.0.0.0/8"),
        ("cluster_cidr: not-a-network\n", "is not a network CIDR"),
        ("cluster_cidr: 'fd00::/8'\n", "Ray and Alpa need an IPv4 cluster network"),
        ("admin_cidrs: [300.1.1.0/24]\n", "admin_cidrs '300.1.1.0/24' is not a network CIDR"),
        ("ports: {gcs: 0}\n", "ports.gcs is 0; a port must be a whole number from 1 to 65535"),
        ("ports: {gcs: 70000}\n", "ports.gcs is 70000"),
        ("ports: {gcs: true}\n", "ports.gcs is True"),
        ("ranges: {ephemeral: [49999, 40000]}\n", "the first port must not exceed the last"),
        ("ranges: {ephemeral: [40000]}\n", "write a range as [first, last]"),
        ("jax_coordinator_port: 30000\n", "jax_coordinator_port 30000 lies outside range xla_grpc 20000-24999"),
        ("admin_ports: [dashbord]\n", "admin_ports names 'dashbord', which is no port or range"),
        ("head_only_ports: [xla_grpc]\n", "head_only_ports names 'xla_grpc', which is no port"),
        ("versions: {ray_modern: 2.60}\n", "versions.ray_modern must be a quoted string"),
        ("ports: [22, 6379]\n", "ports must be a mapping"),
    ],
)
def test_invalid_values_are_refused_with_the_fix(tmp_path, text, expected):
    assert expected in refused(tmp_path, text)


def test_admin_cidrs_may_be_ipv4_or_ipv6(tmp_path):
    spec = load_spec(write(tmp_path, "admin_cidrs: [192.168.0.0/16, '2001:db8::/32']\n"))
    assert spec.admin_cidrs == ("192.168.0.0/16", "2001:db8::/32")
    assert [s.name for s in spec.admin_tcp_ports()] == ["ssh", "dashboard"]
    assert [s.name for s in spec.admin_tcp_ports("worker")] == ["ssh"]  # no dashboard on workers


def test_unreadable_files_are_user_errors(tmp_path):
    with pytest.raises(KitError, match="file not found"):
        load_spec(str(tmp_path / "missing.yaml"))
    assert "is not valid YAML" in refused(tmp_path, "ports: {gcs: [\n")
    assert "must be a YAML mapping" in refused(tmp_path, "- just\n- a list\n")
