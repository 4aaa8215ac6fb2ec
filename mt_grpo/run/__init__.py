"""The run's wiring: from a config to the trainer's parts (`builders`), the rules across fields (`checks`), metrics,
records and the console (`reporting`), and evaluation (`evaluation`)."""
