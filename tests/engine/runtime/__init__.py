"""tests.engine.runtime"""
