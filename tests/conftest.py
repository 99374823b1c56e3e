"""Test-wide settings."""

import os

import pytest
import torch

# One torch thread per test process: the suite shares 2 cores with the fleet
# processes it spawns, and oversubscribed intra-op threads slow CPU torch ~10x.
torch.set_num_threads(1)
os.environ.setdefault("MUJOCO_GL", "egl")


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback for the session, its fake credentials in the environment.
    Skips (saying how to install it) where moto is not installed."""
    from s3_server import moto_available, running

    if not moto_available():
        pytest.skip("moto is not installed (`make setup` installs it; docs/guide/store.md)")
    with running() as server:
        yield server


# The slow tests (pyproject's `slow` marker) of the files that do not mark them themselves
# yet: each spawns the CLI or another interpreter, or runs for many seconds. A mark belongs
# on its test; move these into their files with the files' next change, and drop this table.
SLOW_TESTS = {
    "test_steering.py": {
        "test_steer_cli_selects_alpha_publishes_and_records_auditable_extras", "test_steer_eval_grid_and_report",
        "test_bad_sources_are_typed_errors", "test_a_prior_learned_from_store_data_steers_with_its_fitted_std",
        "test_selector_store_of_another_env_is_refused_by_its_observations",
        # their module's actor store is trained by the CLI
        "test_gaussian_bc_learns_the_old_goal_and_an_honest_std", "test_selector_reads_only_states_and_caps_alpha",
    },
    "test_steering_bandit.py": {
        "test_steer_with_the_bandit_records_its_choice_and_spent_episodes",
        "test_bad_bandit_settings_are_one_line_config_errors",
    },
    "test_steering_envs.py": {"test_collect_point_mass_from_the_cli"},
    "test_store_append.py": {
        "test_snapshots_read_what_was_committed_while_another_process_writes",
        "test_kill_between_chunk_writes_and_commit_record",
    },
    "test_store_faults.py": {
        "test_sigkill_during_commits_never_exposes_partial_episodes", "test_four_concurrent_writers_200_episodes",
        "test_a_writer_refuses_a_chunk_file_cut_short_after_commit",
        "test_a_lost_group_metadata_file_is_written_again_by_the_next_writer",
        "test_a_writer_names_the_array_whose_metadata_is_damaged",
    },
    "test_store_trust.py": {
        "test_no_damage_to_any_file_is_read_silently", "test_a_deleted_commit_record_is_reported_refused_and_repaired",
        "test_a_damaged_newest_commit_slot_is_reported_and_repaired",
        "test_an_undecodable_chunk_is_a_store_error_naming_the_array",
        "test_a_read_only_store_opens_snapshots_loads_and_samples", "test_a_broken_store_json_is_named",
        "test_a_shard_folder_deleted_whole_is_warned_about_by_info_train_and_collect",
        "test_a_full_disk_is_named_and_leaves_a_readable_store",
        "test_a_write_past_the_file_size_limit_names_its_path_and_the_rerun_finishes",
    },
    "test_store_v2.py": {"test_roles_at_commit_filters_and_info"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # a test on the S3 server waits on a moto process and its requests
        if getattr(item, "originalname", None) in SLOW_TESTS.get(item.path.name, ()) or \
                "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
