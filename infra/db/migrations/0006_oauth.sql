-- The MCP front's OAuth 2.1 authorization server (issue #10). Every secret a client or person holds
-- (client secrets, authorization codes, access and refresh tokens, consent CSRF tokens, pending
-- request handles) is stored only as its SHA-256 digest: a copy of this database lets nobody act
-- as anyone. Everything a request needs lives here, not in a process's memory, so any number of MCP
-- nodes behind a load balancer answer the same way and a restarted node keeps every grant.

-- Registered clients (RFC 7591 dynamic registration). metadata is the registration as accepted,
-- without the secret; a record whose metadata no longer validates is refused (fail closed).
create table oauth_clients (
    client_id          text primary key check (length(client_id) between 1 and 200),
    client_secret_hash bytea check (client_secret_hash is null or length(client_secret_hash) = 32),
    metadata           jsonb not null,
    created_at         timestamptz not null default now()
);

-- Authorization requests that passed every check and wait for the person's decision on the
-- consent page. The handle in the consent URL and the CSRF token set with the page are hashed.
create table oauth_pending (
    request_hash bytea primary key check (length(request_hash) = 32),
    client_id    text not null references oauth_clients (client_id) on delete cascade,
    params       jsonb not null,
    csrf_hash    bytea check (csrf_hash is null or length(csrf_hash) = 32),
    expires_at   timestamptz not null
);
create index oauth_pending_expires on oauth_pending (expires_at);

-- One approval on the consent page: a client acting as one agent with some scopes for one
-- resource. Its codes and tokens form one family: revoking the grant revokes all of them.
create table oauth_grants (
    grant_id   uuid primary key,
    client_id  text not null references oauth_clients (client_id) on delete cascade,
    agent_id   uuid not null references agents (agent_id),
    scopes     text[] not null check (cardinality(scopes) > 0),
    resource   text not null,
    created_at timestamptz not null default now(),
    revoked_at timestamptz
);
create index oauth_grants_client on oauth_grants (client_id);

-- Authorization codes: single use (used_at), 5 minutes.
create table oauth_codes (
    code_hash      bytea primary key check (length(code_hash) = 32),
    grant_id       uuid not null references oauth_grants (grant_id) on delete cascade,
    code_challenge text not null,
    redirect_uri   text not null,
    redirect_uri_explicit boolean not null,
    expires_at     timestamptz not null,
    used_at        timestamptz
);

-- Access and refresh tokens. A refresh token is rotated once (rotated_at); the successor pair is
-- derived from the presented token and rotation_salt, so an identical retry within the grace
-- window gets the same pair back without the database holding any raw token.
create table oauth_tokens (
    token_hash    bytea primary key check (length(token_hash) = 32),
    kind          text not null check (kind in ('access', 'refresh')),
    grant_id      uuid not null references oauth_grants (grant_id) on delete cascade,
    scopes        text[] not null check (cardinality(scopes) > 0),
    expires_at    timestamptz not null,
    created_at    timestamptz not null default now(),
    rotated_at    timestamptz,
    rotation_salt bytea,
    revoked_at    timestamptz
);
create index oauth_tokens_grant on oauth_tokens (grant_id);
create index oauth_tokens_expires on oauth_tokens (expires_at);

-- Per-address budget of authorization requests (TOASTMACHINE_MCP_AUTHORIZE_PER_MINUTE), the GCRA of
-- migration 0005: one statement charges it, so any number of MCP nodes share the limit. Rows whose
-- tat is past carry no state; each charge deletes a few of them.
create table oauth_authorize_budget (
    address inet primary key,
    tat     timestamptz not null
);
create index oauth_authorize_budget_tat on oauth_authorize_budget (tat);
