"""gateway <-> gateway: with several gateway processes, what one asks the others (the
operator's view is the whole server, not the process a connection happened to reach)."""

from __future__ import annotations

from typing import Any

from common.codec import message


@message("gateway_query")
class GatewayQuery:
    """Asked of every other gateway process; each answers with a GatewayAnswer."""

    reply_to: str  # the asker's inbox
    query_id: int
    # "cancel": end the request `request_id` if this process holds it ({"cancelled": bool});
    # "requests": this process's live requests ({"requests": [row, ...]})
    what: str
    request_id: str = ""


@message("gateway_answer")
class GatewayAnswer:
    name: str  # the answering process (gateway-1)
    query_id: int
    data: dict[str, Any]
