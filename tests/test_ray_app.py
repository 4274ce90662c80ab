"""build_app and its config, without a cluster: the YAML import path, Serve's options, the CLI's flags."""

from __future__ import annotations

import argparse
import os
from types import FunctionType

import pytest

pytest.importorskip("ray.serve")

from pydantic import ValidationError  # noqa: E402
from ray._common.utils import import_module_and_attr  # noqa: E402
from ray.serve import Application  # noqa: E402
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # noqa: E402

from cobatch.ray.app_config import AppConfig  # noqa: E402
from cobatch.ray.builder import engine_deployment_options  # noqa: E402
from cobatch.ray.launch import app_config_from_args  # noqa: E402
from cobatch.server.cli import add_serve_arguments, engine_config_from_args  # noqa: E402
from cobatch.server.settings import ServerSettings  # noqa: E402

ARGS = {"engine": {"model": "/nonexistent/model", "max_num_seqs": 8}, "served_model_name": "m"}


def test_the_yaml_import_path_is_a_one_argument_builder_serve_can_call() -> None:
    _, builder = import_module_and_attr("cobatch.ray:build_app")
    assert isinstance(builder, FunctionType)
    app = call_user_app_builder_with_args_if_necessary(builder, ARGS)  # what `serve run` does
    assert isinstance(app, Application)


def test_a_bad_engine_option_fails_validation() -> None:
    with pytest.raises(ValidationError, match="max_num_seqs"):
        AppConfig.model_validate({"engine": {"max_num_seqs": 0}})
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engine": {}, "replicas": 2})  # unknown field


def test_threads_default_to_cores_over_replicas_and_every_option_reaches_each_replica() -> None:
    config = AppConfig.model_validate({**ARGS, "num_replicas": 2, "max_queued_requests": 3})
    assert config.threads_per_replica() == max(1, (os.cpu_count() or 1) // 2)
    engine_config = config.engine_config()
    assert engine_config.max_num_seqs == 8 and engine_config.num_threads == config.threads_per_replica()
    options = engine_deployment_options(config, engine_config)
    assert options["num_replicas"] == 2
    assert options["ray_actor_options"] == {"num_cpus": config.threads_per_replica()}
    assert options["max_ongoing_requests"] > 8 + 3  # Serve's cap never gates before the router
    router = options["request_router_config"]
    assert router.request_routing_stats_period_s <= 1.0
    assert router.request_router_kwargs == {"block_size": engine_config.block_size}


def test_autoscaling_is_passed_through() -> None:
    config = AppConfig.model_validate({**ARGS, "num_replicas": 1, "min_replicas": 1, "max_replicas": 4,
                                       "target_ongoing_requests": 8})
    assert config.replica_count_options() == {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 8}}


def test_the_serve_flags_build_the_app_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["/some/model", "--replicas", "3", "--max-num-seqs", "12",
                              "--num-threads", "2", "--router", "round_robin",
                              "--max-queued-requests", "5"])
    engine_config = engine_config_from_args(args)
    config = app_config_from_args(args, engine_config, ServerSettings(served_model_name="m"))
    assert (config.num_replicas, config.router, config.max_queued_requests) == (3, "round_robin", 5)
    assert config.engine_config().max_num_seqs == 12 and config.threads_per_replica() == 2
