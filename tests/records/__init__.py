"""tests.records"""
