"""The store's schema: numbered migrations, applied in order by ``Store`` when it opens a file."""

from __future__ import annotations

# (version, name, sql), applied in order, one transaction each. Append only: never edit one that has shipped.
# JSON columns are VARCHAR holding JSON text; created_at/updated_at are server-side so callers never pass them.
MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "runs_hcp_trajectories",
        """
        CREATE TABLE runs (
            run_id VARCHAR PRIMARY KEY, config VARCHAR NOT NULL, created_at TIMESTAMP DEFAULT current_timestamp
        );
        CREATE TABLE hcp_configs (
            hcp_id VARCHAR PRIMARY KEY, name VARCHAR NOT NULL, body VARCHAR NOT NULL,
            created_at TIMESTAMP DEFAULT current_timestamp
        );
        CREATE TABLE trajectories (
            run_id VARCHAR NOT NULL, hcp_id VARCHAR NOT NULL, adapter VARCHAR NOT NULL, task_id VARCHAR NOT NULL,
            sample INTEGER NOT NULL, split VARCHAR NOT NULL, tier INTEGER NOT NULL, round INTEGER NOT NULL,
            stage VARCHAR NOT NULL,
            messages VARCHAR NOT NULL,  -- JSON list of OpenAI-format messages
            reward DOUBLE NOT NULL, feedback VARCHAR NOT NULL, error VARCHAR NOT NULL,
            prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL, latency_s DOUBLE NOT NULL,
            schema_version INTEGER NOT NULL, created_at TIMESTAMP DEFAULT current_timestamp,
            PRIMARY KEY (run_id, hcp_id, adapter, task_id, sample)
        );
        """,
    ),
    (
        2,
        "candidates_selections",
        """
        CREATE SEQUENCE candidates_seq;
        CREATE TABLE candidates (
            run_id VARCHAR NOT NULL, round INTEGER NOT NULL, hcp_id VARCHAR NOT NULL, parent_id VARCHAR,
            mutator VARCHAR NOT NULL, status VARCHAR NOT NULL,
            scores VARCHAR NOT NULL,  -- JSON: task_id -> mean reward
            mean_reward DOUBLE NOT NULL, note VARCHAR NOT NULL, schema_version INTEGER NOT NULL,
            seq BIGINT NOT NULL DEFAULT nextval('candidates_seq'),  -- first-insertion order survives upserts
            created_at TIMESTAMP DEFAULT current_timestamp, updated_at TIMESTAMP DEFAULT current_timestamp,
            PRIMARY KEY (run_id, round, hcp_id)
        );
        CREATE SEQUENCE selections_seq;
        CREATE TABLE selections (
            id VARCHAR PRIMARY KEY, run_id VARCHAR NOT NULL, round INTEGER NOT NULL,
            baseline_hcp_id VARCHAR NOT NULL, evolved_hcp_id VARCHAR NOT NULL, adapter VARCHAR NOT NULL,
            schema_version INTEGER NOT NULL, seq BIGINT NOT NULL DEFAULT nextval('selections_seq'),
            created_at TIMESTAMP DEFAULT current_timestamp
        );
        CREATE TABLE selection_items (
            selection_id VARCHAR NOT NULL, position INTEGER NOT NULL,
            task_id VARCHAR NOT NULL, hcp_id VARCHAR NOT NULL, adapter VARCHAR NOT NULL, sample INTEGER NOT NULL,
            reward DOUBLE NOT NULL, baseline_hcp_id VARCHAR NOT NULL, baseline_sample INTEGER NOT NULL,
            baseline_reward DOUBLE NOT NULL, schema_version INTEGER NOT NULL,
            PRIMARY KEY (selection_id, position)
        );
        """,
    ),
    (
        3,
        "adapters_evaluations",
        """
        CREATE TABLE adapters (
            name VARCHAR NOT NULL, version INTEGER NOT NULL, tier INTEGER NOT NULL, routing_rule VARCHAR NOT NULL,
            base_model VARCHAR NOT NULL, path VARCHAR NOT NULL, parent_version INTEGER, run_id VARCHAR NOT NULL,
            round INTEGER NOT NULL, hcp_id VARCHAR NOT NULL, evolved_hcp_id VARCHAR NOT NULL,
            selection_id VARCHAR NOT NULL,
            eval VARCHAR NOT NULL,  -- JSON
            status VARCHAR NOT NULL, reason VARCHAR NOT NULL, schema_version INTEGER NOT NULL,
            created_at TIMESTAMP DEFAULT current_timestamp, updated_at TIMESTAMP DEFAULT current_timestamp,
            PRIMARY KEY (name, version)
        );
        CREATE TABLE evaluations (
            run_id VARCHAR NOT NULL, round INTEGER NOT NULL, split VARCHAR NOT NULL, decision VARCHAR NOT NULL,
            body VARCHAR NOT NULL,  -- JSON: the whole EvalReport
            created_at TIMESTAMP DEFAULT current_timestamp, updated_at TIMESTAMP DEFAULT current_timestamp,
            PRIMARY KEY (run_id, round, split)
        );
        """,
    ),
    (
        4,
        "candidate_lineage",
        """
        ALTER TABLE candidates ADD COLUMN parents VARCHAR NOT NULL DEFAULT '[]';  -- JSON list of HCP ids
        UPDATE candidates SET parents = to_json([parent_id])::VARCHAR WHERE parent_id IS NOT NULL;
        ALTER TABLE candidates DROP COLUMN parent_id;
        ALTER TABLE candidates ADD COLUMN components VARCHAR NOT NULL DEFAULT '[]';  -- JSON list of names
        ALTER TABLE candidates ADD COLUMN diff VARCHAR NOT NULL DEFAULT '';
        ALTER TABLE candidates ADD COLUMN minibatch VARCHAR NOT NULL DEFAULT '{}';  -- JSON: task_id -> mean
        ALTER TABLE candidates ADD COLUMN parent_minibatch VARCHAR NOT NULL DEFAULT '{}';
        ALTER TABLE candidates ADD COLUMN spreads VARCHAR NOT NULL DEFAULT '{}';  -- JSON: task_id -> std
        ALTER TABLE candidates ADD COLUMN rollouts_used BIGINT NOT NULL DEFAULT 0;
        """,
    ),
    (
        5,
        "experts_live_version",
        """
        CREATE TABLE experts (
            name VARCHAR PRIMARY KEY, tier INTEGER NOT NULL, routing_rule VARCHAR NOT NULL,
            base_model VARCHAR NOT NULL,
            live_version INTEGER,  -- the one promoted version; NULL: the bare base model serves the expert
            schema_version INTEGER NOT NULL,
            created_at TIMESTAMP DEFAULT current_timestamp, updated_at TIMESTAMP DEFAULT current_timestamp
        );
        INSERT INTO experts (name, tier, routing_rule, base_model, live_version, schema_version)
            SELECT name, max(tier), max(routing_rule), max(base_model),
                   max(version) FILTER (WHERE status = 'promoted'), 1
            FROM adapters GROUP BY name;
        UPDATE adapters SET status = 'retired'
            WHERE status = 'promoted' AND version <> (SELECT live_version FROM experts e WHERE e.name = adapters.name);
        CREATE TABLE registry_events (
            expert VARCHAR NOT NULL, action VARCHAR NOT NULL, version INTEGER, previous_version INTEGER,
            detail VARCHAR NOT NULL, schema_version INTEGER NOT NULL,
            created_at TIMESTAMP DEFAULT current_timestamp
        );
        """,
    ),
    (
        6,
        "stage_results",
        """
        CREATE TABLE stage_results (
            run_id VARCHAR NOT NULL, round INTEGER NOT NULL, stage VARCHAR NOT NULL,
            result VARCHAR NOT NULL,  -- JSON: what the stage handed on (ids of stored records, reports)
            seconds DOUBLE NOT NULL, created_at TIMESTAMP DEFAULT current_timestamp,
            PRIMARY KEY (run_id, round, stage)
        );
        """,
    ),
    (
        7,
        "registry_event_order",
        # created_at is the transaction's start, not its commit: two racing promotions can commit in the other
        # order, so the history is ordered by a sequence drawn inside the transaction, after its reads.
        """
        CREATE SEQUENCE registry_events_seq;
        ALTER TABLE registry_events ADD COLUMN seq BIGINT DEFAULT nextval('registry_events_seq');
        """,
    ),
]

LATEST_VERSION = max(v for v, _, _ in MIGRATIONS)
