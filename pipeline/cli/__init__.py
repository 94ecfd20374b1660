"""pipeline/cli"""
