"""The ``zmq`` connector: a sender serves its payloads to pulling receivers over ZMQ."""
