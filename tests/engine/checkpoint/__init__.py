"""tests.engine.checkpoint"""
