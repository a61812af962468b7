"""The target model that extraction, generation and eval run: loading it, tapping its decoder
layers, its key/value cache, and sharding it over several processes (`--tp`). It imports only
core/ and cache/ of the project."""
