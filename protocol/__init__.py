"""Pure protocol of ToastMachine: typed messages, limits, errors and their (de)serialisation.

Nothing in this package performs I/O or imports aio-pika, asyncpg or aiohttp.
"""
