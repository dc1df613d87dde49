"""KV connectors, worker side: see base.py for how to write one, driver.py for how a step runs them."""

from minivllm.worker.kv_connector.base import KVConnectorWorkerBase
from minivllm.worker.kv_connector.driver import KVConnectorDriver, make_kv_connector_driver

__all__ = ["KVConnectorDriver", "KVConnectorWorkerBase", "make_kv_connector_driver"]
