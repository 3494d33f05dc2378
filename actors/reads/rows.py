"""Rows of the corpus tables as the public representations of SPEC §3, and the SQL that selects them.

Every read route (and the snapshot export) selects its records with the column lists here and
turns each row into its representation with the builders here, so a message looks the same
whichever route shows it, and the same as in the change history the writer recorded.
"""

from __future__ import annotations

from typing import Any

from protocol import representations as rep

#: The names of a message's mentioned agents, in mention order (``m`` is the messages row).
#: One primary-key lookup per mention (a join would make the planner hash the whole agents table).
MENTION_NAMES = (
    "array(select (select g.name from agents g where g.agent_id = u.agent_id)"
    " from unnest(m.mention_ids) with ordinality as u(agent_id, ord) order by u.ord) as mention_names")

#: A message with its sequence and names: ``from`` :data:`MESSAGE_FROM` (alias f, m, a).
MESSAGE_COLUMNS = (
    "f.sequence, m.id, m.conversation_id, m.author_id, a.name as author_name, m.created_at, m.kinds,"
    " m.content, m.payload, m.schema_name, m.schema_version, m.reply_to, m.tags, m.mention_ids, "
    + MENTION_NAMES)
MESSAGE_FROM = (
    " from message_feed f join messages m on m.id = f.message_id join agents a on a.agent_id = m.author_id")

#: A conversation with its activity: ``from`` :data:`CONVERSATION_FROM` (alias ca, c, a).
CONVERSATION_COLUMNS = (
    "c.id, c.subject, c.author_id, a.name as author_name, c.root_message_id, c.created_at,"
    " ca.created_sequence as sequence, ca.message_count, ca.last_sequence")
CONVERSATION_FROM = (
    " from conversation_activity ca join conversations c on c.id = ca.conversation_id"
    " join agents a on a.agent_id = c.author_id")

#: A relationship assertion with its retraction, if any: ``from`` :data:`RELATIONSHIP_FROM`.
RELATIONSHIP_COLUMNS = (
    "ch.sequence, r.id, r.type, r.source_message_id, r.target_message_id, r.author_id,"
    " a.name as author_name, r.created_at, x.id as retraction_id, xc.sequence as retraction_sequence,"
    " x.created_at as retraction_created_at")
RELATIONSHIP_FROM = (
    " from relationships r join changes ch on ch.relationship_id = r.id join agents a on a.agent_id = r.author_id"
    " left join retractions x on x.relationship_id = r.id left join changes xc on xc.retraction_id = x.id")

#: An agent with its activity (agents with none have zeros): ``from`` :data:`AGENT_FROM` (alias g, aa).
AGENT_COLUMNS = (
    "g.agent_id, g.name, g.description, g.created_at, coalesce(aa.message_count, 0) as message_count,"
    " coalesce(aa.conversation_count, 0) as conversation_count, aa.last_sequence")
AGENT_FROM = " from agents g left join agent_activity aa on aa.agent_id = g.agent_id"


def conversation(row: Any) -> dict[str, Any]:
    """A conversation row (``sequence`` = its creation sequence) as its representation."""
    return rep.conversation(
        id=str(row["id"]), subject=row["subject"], author_id=str(row["author_id"]),
        author_name=row["author_name"], root_message_id=str(row["root_message_id"]),
        created_sequence=row["sequence"], created_at=row["created_at"], message_count=row["message_count"],
        last_sequence=row["last_sequence"])


def message(row: Any) -> dict[str, Any]:
    """A message row as its representation."""
    return rep.message(
        id=str(row["id"]), conversation_id=str(row["conversation_id"]), author_id=str(row["author_id"]),
        author_name=row["author_name"], sequence=row["sequence"], created_at=row["created_at"],
        kinds=row["kinds"], content=row["content"], payload_json=row["payload"],
        schema_name=row["schema_name"], schema_version=row["schema_version"],
        reply_to=str(row["reply_to"]) if row["reply_to"] is not None else None, tags=row["tags"],
        mentions=[(str(i), n) for i, n in zip(row["mention_ids"], row["mention_names"], strict=True)])


def relationship(row: Any) -> dict[str, Any]:
    """A relationship row (with its retraction columns) as its representation."""
    retraction = None
    if row["retraction_id"] is not None:
        retraction = rep.retraction_ref(id=str(row["retraction_id"]), sequence=row["retraction_sequence"],
                                        created_at=row["retraction_created_at"])
    return rep.relationship(
        id=str(row["id"]), type=row["type"], source_message_id=str(row["source_message_id"]),
        target_message_id=str(row["target_message_id"]), author_id=str(row["author_id"]),
        author_name=row["author_name"], sequence=row["sequence"], created_at=row["created_at"],
        retraction=retraction)


def agent(row: Any) -> dict[str, Any]:
    """An agent row (with its activity columns) as its representation."""
    out: dict[str, Any] = {"agent_id": str(row["agent_id"]), "name": row["name"]}
    if row["description"] is not None:
        out["description"] = row["description"]
    out["created_at"] = rep.format_time(row["created_at"])
    out["activity"] = activity(row)
    return out


def activity(row: Any) -> dict[str, Any]:
    """An agent's activity columns as its ``activity``; ``last_sequence`` absent (not null) until
    the agent's first change, as every optional field."""
    out: dict[str, Any] = {"message_count": row["message_count"], "conversation_count": row["conversation_count"]}
    if row["last_sequence"] is not None:
        out["last_sequence"] = row["last_sequence"]
    return out
