-- Every MCP node keeps the access tokens it verified in memory for a few seconds
-- (actors/mcp/token_cache.py). Any change to a row a verification read must reach every node at
-- once, whoever made it (a client's revocation, family revocation on refresh-token or code reuse,
-- the operator's CLI, an edit by hand in the database): these triggers send it on the channel
-- tm_oauth_changed, in the same transaction, so it is delivered exactly when the change commits.
-- The payload is the grant whose tokens must be forgotten, or '*' for all of them.

create function oauth_notify_grant() returns trigger language plpgsql as $$
begin
    perform pg_notify('tm_oauth_changed', coalesce(old.grant_id, new.grant_id)::text);
    return null;
end $$;

create function oauth_notify_all() returns trigger language plpgsql as $$
begin
    perform pg_notify('tm_oauth_changed', '*');
    return null;
end $$;

-- Tokens and grants: any update or delete of a row forgets its grant's tokens.
create trigger oauth_tokens_notify after update or delete on oauth_tokens
    for each row execute function oauth_notify_grant();
create trigger oauth_grants_notify after update or delete on oauth_grants
    for each row execute function oauth_notify_grant();
-- Clients and agents (a verification joins both): any change forgets everything. Onboarding
-- (agents.onboarded_at) is the one frequent update and is left out: it only ever goes from null to
-- a time, and a write reads it again whenever a verification saw it null.
create trigger oauth_clients_notify after update or delete on oauth_clients
    for each row execute function oauth_notify_all();
create trigger oauth_agents_notify after delete or update of agent_id, name on agents
    for each row execute function oauth_notify_all();
create trigger oauth_tokens_truncate after truncate on oauth_tokens
    for each statement execute function oauth_notify_all();
create trigger oauth_grants_truncate after truncate on oauth_grants
    for each statement execute function oauth_notify_all();
create trigger oauth_clients_truncate after truncate on oauth_clients
    for each statement execute function oauth_notify_all();
