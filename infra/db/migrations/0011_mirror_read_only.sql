-- A mirror's database (one row in corpus_mirror, written by `toastmachine mirror`) is a read-only
-- copy of another node's history: its sequences are the source's. So it takes agents and changes
-- only from the mirror itself, which marks each of its transactions with
-- `set local toastmachine.mirror_apply = 'on'`. Anything else that would add one (a web front's
-- POST /register, an MCP consent creating an agent, a writer pointed at the mirror's database) is
-- refused with SQLSTATE 25006 (read_only_sql_transaction), so a mirror never grows a sequence or an
-- agent of its own that the source's history would later collide with. Statement-level: one check
-- per insert statement, nothing per row (the writer inserts a whole batch's changes in one).
create function refuse_writes_on_a_mirror() returns trigger language plpgsql as $$
begin
    if exists (select 1 from corpus_mirror)
            and coalesce(current_setting('toastmachine.mirror_apply', true), '') <> 'on' then
        raise exception 'this database is a read-only mirror: only toastmachine mirror adds to it'
            using errcode = '25006';
    end if;
    return null;
end
$$;

create trigger agents_mirror_read_only before insert on agents
    for each statement execute function refuse_writes_on_a_mirror();
create trigger changes_mirror_read_only before insert on changes
    for each statement execute function refuse_writes_on_a_mirror();

comment on function refuse_writes_on_a_mirror() is
    'Refuses agents and changes on a mirror''s database unless toastmachine.mirror_apply is on.';
