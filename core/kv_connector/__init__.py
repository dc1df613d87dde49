"""KV connectors, scheduler side (pure Python): see base.py for how to write one."""

from minivllm.core.kv_connector.base import KVConnectorSchedulerBase, make_scheduler_connector

__all__ = ["KVConnectorSchedulerBase", "make_scheduler_connector"]
