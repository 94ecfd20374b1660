"""tests.gpu"""
