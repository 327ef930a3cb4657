"""Ray's HTTP APIs on the head's dashboard port: the state API (nodes), the log API, the jobs API.

This is what `ray.util.state.list_nodes / list_logs / get_log` and `ray job` call underneath
(/api/v0/nodes, /api/v0/logs, /api/v0/logs/file, /api/jobs/), spoken directly because:

- a controller outside the cluster reaches the head's dashboard port (an admin port in cluster.yaml)
  but not its GCS port, and list_logs/get_log find the dashboard through the GCS;
- list_logs/get_log send their HTTP request without a client timeout, and RAY_ADDRESS in the
  environment silently overrides the address given to the state client;
- the token (Ray >= 2.52 token auth) is one explicit header, not process-wide settings.

Every request has a timeout. Standard library + requests (a Ray dependency): imports on the Alpa image.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional

from alpa_job.errors import EXIT_TIMEOUT, KitError

REQUEST_TIMEOUT_S = 10.0
LIST_LIMIT = 10000


class RayHttpError(KitError):
    """The dashboard answered with an error (or not at all); the message names the URL."""


class RayHttp:
    def __init__(self, url: str, token: Optional[str] = None, timeout_s: float = REQUEST_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        import requests

        self._session = requests.Session()
        if token:
            self._session.headers["Authorization"] = "Bearer " + token

    def _get(self, path: str, params: Optional[Mapping[str, Any]] = None, stream: bool = False, timeout_s: Optional[float] = None):
        import requests

        timeout = timeout_s or self.timeout_s
        try:
            r = self._session.get(self.url + path, params=params, stream=stream, timeout=(min(timeout, 5.0), timeout))
        except requests.exceptions.Timeout:
            raise RayHttpError(
                "Ray's dashboard at %s did not answer %s within %.0f s; check that the head is up and "
                "its dashboard port open to this host" % (self.url, path, timeout),
                EXIT_TIMEOUT,
            ) from None
        except requests.exceptions.RequestException as err:
            raise RayHttpError(
                "cannot reach Ray's dashboard at %s (%s); is Ray up on the head (python -m alpa_job cluster up)?" % (self.url, _short(err)),
                EXIT_TIMEOUT,
            ) from None
        if r.status_code in (401, 403):
            raise RayHttpError(
                "Ray at %s refused the request (HTTP %d: token auth is on and %s); set RAY_AUTH_TOKEN "
                "or the inventory's ray_cluster_auth_token_file"
                % (self.url, r.status_code, "the token is wrong" if self.token else "no token was given")
            )
        if r.status_code >= 400:
            raise RayHttpError("Ray at %s answered %s with HTTP %d: %s" % (self.url, path, r.status_code, _short(r.text)))
        return r

    def json(self, path: str, params: Optional[Mapping[str, Any]] = None) -> Any:
        r = self._get(path, params)
        try:
            return r.json()
        except ValueError:
            raise RayHttpError("Ray at %s answered %s with something that is not JSON: %s" % (self.url, path, _short(r.text))) from None

    def _state(self, path: str, params: Mapping[str, Any]) -> Any:
        """The data of a state-API response ({"result": bool, "msg", "data": {"result": ...}})."""
        body = self.json(path, params)
        if isinstance(body, Mapping) and body.get("result") is False:
            raise RayHttpError(
                "Ray's state API at %s%s failed: %s (see the head's dashboard.log)" % (self.url, path, _short(body.get("msg")))
            )
        return ((body or {}).get("data") or {}).get("result")

    # ---- what the cluster commands ask ----------------------------------------------------------------
    def auth_mode(self) -> str:
        """ "token" or "disabled" (a public endpoint); "unknown" on a Ray without it (< 2.52)."""
        try:
            return str(self.json("/api/authentication_mode").get("authentication_mode") or "unknown")
        except RayHttpError as err:
            if "HTTP 404" in str(err):
                return "unknown"
            raise

    def version(self) -> Dict[str, Any]:
        """{"ray_version", "ray_commit", "session_name", "version"} of the head."""
        return dict(self.json("/api/version"))

    def nodes(self) -> List[Dict[str, Any]]:
        """The state API's node rows (node_ip, state, is_head_node, resources_total, labels, ...), dead included."""
        data = self._state("/api/v0/nodes", {"limit": LIST_LIMIT, "timeout": int(self.timeout_s), "detail": "true"})
        rows = data.get("result") if isinstance(data, Mapping) else data
        return list(rows or [])

    def jobs(self) -> List[Dict[str, Any]]:
        """The jobs API's submissions (submission_id, job_id, status, ...)."""
        rows = self.json("/api/jobs/")
        return list(rows or []) if isinstance(rows, list) else []

    def list_logs(self, node_ip: str, glob: str = "*") -> Dict[str, List[str]]:
        """{category: [file names]} of a node's Ray log directory (list_logs)."""
        data = self._state("/api/v0/logs", {"node_ip": node_ip, "glob": glob, "timeout": int(self.timeout_s)})
        return {str(k): list(v or []) for k, v in (data or {}).items()}

    def get_log(self, node_ip: str, filename: str, lines: int = -1, timeout_s: Optional[float] = None) -> Iterator[bytes]:
        """A log file's bytes in chunks (get_log, media_type=file); `lines` > 0: only its last lines."""
        timeout = timeout_s or max(self.timeout_s, 60.0)
        r = self._get(
            "/api/v0/logs/file",
            {"node_ip": node_ip, "filename": filename, "lines": lines, "media_type": "file", "timeout": int(timeout)},
            stream=True,
            timeout_s=timeout,
        )
        with r:
            for chunk in r.iter_content(chunk_size=1 << 16):
                if chunk:
                    yield chunk


def _short(value: Any) -> str:
    return " ".join(str(value or "").split())[:300]


def dashboard_url(spec, head_ip: str) -> str:
    """The jobs API / dashboard URL of a head: http://HEAD_IP:<spec's dashboard port>."""
    return "http://%s:%d" % (head_ip, spec.ports["dashboard"])


def token_from_env() -> Optional[str]:
    """The token a client without an inventory sends: RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names."""
    import os

    token = os.environ.get("RAY_AUTH_TOKEN")
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not token and path and os.path.isfile(path):
        with open(path) as f:
            token = f.read().strip()
    return token or None
