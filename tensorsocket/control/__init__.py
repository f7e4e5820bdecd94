"""The control plane over ZeroMQ: the producer's server and the consumer's client, the message
protocol, authentication, endpoints, the producer's files and its watchdog."""
