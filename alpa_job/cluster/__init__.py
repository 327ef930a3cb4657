"""The cluster: what runs on or about its nodes, all read from one spec (cluster.yaml).

- spec.py + cluster.yaml: the cluster's shape (CIDR, every port and range, versions, image tags);
- node_ip.py: this host's address in the cluster CIDR; ray_start.py: the exact `ray start` argv;
- firewall.py: the nftables ruleset; netpol.py, kuberay.py: the same plan on Kubernetes;
- ray_api.py: the one GCS address, bounded joins, alive nodes; wait_nodes.py: wait until N joined;
- worker_path.py: the PYTHONPATH a Ray worker needs to import the kit;
- doctor/: `python -m alpa_job doctor`, the running cluster checked against the spec;
- control/: `python -m alpa_job cluster up|down|status|logs|preflight`, operating it from a controller.

How a job runs on the cluster (worker group, supervision, restarts) is `alpa_job.launch`.
"""
