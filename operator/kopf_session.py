"""kopf's HTTP session, built here so that the API server's ``Warning`` headers to kopf's own requests are logged.

kopf writes each PagedLLM's status and its handlers' progress, posts events and watches, and
keeps no response headers: a warning answered to those writes (an unknown status field
dropped, a deprecated API version) would go unseen. kopf takes a ready ``aiohttp`` session
from a login handler (``kopf.AiohttpSession``); :func:`session_login` builds it from the
credentials as kopf builds its own, with a trace hook that logs each warning as
:class:`~pagedllm.operator.kube.KubeClient` does for the operator's other writes.
"""

from __future__ import annotations

import logging
import types
import warnings

import aiohttp
import kopf

from pagedllm.operator.kube import api_warnings

LOGGER = logging.getLogger(__name__)


def warning_trace(logger: logging.Logger = LOGGER) -> aiohttp.TraceConfig:
    """A trace that logs the texts of every answer's ``Warning`` headers, naming the request."""

    async def on_request_end(
        session: aiohttp.ClientSession, context: types.SimpleNamespace, params: aiohttp.TraceRequestEndParams
    ) -> None:
        for text in api_warnings(params.response.headers.getall("Warning", [])):
            logger.warning("the API server warned about %s %s: %s", params.method, params.url.path, text)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_request_end)
    return trace


def session_login(info: kopf.ConnectionInfo) -> kopf.AiohttpSession:
    """kopf's credentials as a session of this module's making (to be called on the operator's event loop).

    kopf closes it when the credentials are replaced or the operator stops, as it does its own.
    """
    with warnings.catch_warnings():  # kopf's own deprecation notes on basic auth, as kopf silences them
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="kopf")
        auth = info.as_aiohttp_basic_auth()
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        auth=auth,
        proxy=info.proxy_url,
        trust_env=info.trust_env,
        trace_configs=[warning_trace()],
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        priority=info.priority,
        expiration=info.expiration,
    )
