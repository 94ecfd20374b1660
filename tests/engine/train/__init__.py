"""tests.engine.train"""
