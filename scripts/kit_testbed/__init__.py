"""The multi-host test bed: several real "hosts" on one machine (needs root), and what runs on them.

- ``hosts``: the hosts themselves (namespaces, bridges, exec, state, teardown) and the layer registry;
- ``ray_layer``: the spec's firewall and Ray on every host, the one bring-up;
- ``site_layer``: a user's site: dockerd in every node, a registry on the controller, the CPU image;
- ``sshd``: sshd inside the hosts, so Ansible reaches them over real SSH;
- ``site_bed``: a started site as one object (nodes, controller, daemons, SSH);
- ``ansible_runs``: the kit's playbooks (`alpa_job cluster up|down`) run against the hosts, and their
  summaries.

The two layers register themselves with ``hosts`` when imported, so ``hosts`` never imports them.
``scripts/testbed`` is the command line over these modules; the pytest fixtures (tests/fixtures_*.py) and
the bench scripts import them. Whoever imports them puts the checkout's root on ``sys.path`` first (the
layers import ``alpa_job``): pytest's ``pythonpath``, the CLI, bench/lib/checkout.py.
"""
